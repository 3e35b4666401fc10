"""Prometheus metrics of the gateway, named like vLLM's (``vllm:`` → ``tandem:``) so existing
dashboards and PromQL carry over. Each Gateway owns its registry (several can live in one test
process); ``/metrics`` renders it."""

from __future__ import annotations

import re

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem.bulk_histogram import BulkHistogram

# The *_created series double the output and no dashboard reads them.
prometheus_client.disable_created_metrics()

FINISH_REASONS = ("stop", "length", "abort")  # what a generation that did not fail ends with (the API's finish_reason)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))[:-2]  # vLLM's 1-2-5 steps, to 1M tokens
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0)


class GatewayMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.requests = Counter("tandem:requests", "Requests answered, by API and status (HTTP status, "
                                "or gRPC code name for the gRPC API).", m + ["api", "status"], registry=r)
        self.request_success = Counter("tandem:request_success", "Generations finished, by finish reason.",
                                       m + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens sent to the verifier.", m, registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated.", m, registry=r)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Request arrival to first token.", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        # (observed in bulk: a message of k tokens is one call, not k of a labelled Histogram's)
        self.itl = BulkHistogram("tandem:inter_token_latency_seconds", "Time between tokens; a message of k tokens "
                                 "counts k gaps of 1/k of its wait (speculation delivers several at once).",
                                 _LATENCY_BUCKETS, r, labels={"model_name": model_name})
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Request arrival to last token.", m,
                             buckets=_E2E_BUCKETS, registry=r)
        self.decode_time = Histogram("tandem:request_decode_time_seconds", "First token to last, of requests that "
                                     "finished (vLLM's decode phase).", m, buckets=_E2E_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("tandem:request_prompt_tokens", "Prompt tokens of each request that "
                                               "finished.", m, buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("tandem:request_generation_tokens", "Tokens generated for each "
                                                   "request that finished.", m, buckets=_TOKEN_BUCKETS, registry=r)
        self.running = Gauge("tandem:num_requests_running", "Generations streaming from the verifier now.", m,
                             registry=r)
        self.queued = Gauge("tandem:gateway_requests_waiting", "REST requests waiting in line for generation slots at "
                            "--max-concurrent-requests (up to --max-queue-wait-s).", m, registry=r)
        self.relay_up = {service: Gauge(f"tandem:{service}_metrics_up", f"1 when this scrape holds the {service}'s "
                                        f"metrics (--{service}-metrics-url), 0 when it did not answer in time", m,
                                        registry=r) for service in ("verifier", "drafter")}
        self._model = model_name
        # Every series a dashboard reads exists from the start, at zero (as vLLM's do): a scrape before the first
        # request shows the histograms' buckets and the finish reasons, not only their HELP lines.
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.e2e, self.decode_time,
                       self.request_prompt_tokens, self.request_generation_tokens, self.running):  # (itl: always)
            self.labels(metric)
        for reason in FINISH_REASONS:
            self.labels(self.request_success, finished_reason=reason)

    def watch_queue(self, waiting) -> None:
        """The gauge of requests in line reads ``waiting()`` at each scrape."""
        self.labels(self.queued).set_function(waiting)

    def labels(self, metric, **labels):
        return metric.labels(model_name=self._model, **labels)

    def count_request(self, api: str, status: int | str) -> None:
        self.labels(self.requests, api=api, status=str(status)).inc()

    def names(self) -> set[str]:
        """The metric families this gateway exposes itself."""
        return {family.name for family in self.registry.collect()}

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)

    CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


_FAMILY = re.compile(rb"^(# (?:HELP|TYPE) )?tandem:", re.MULTILINE)


def with_prefix(exposition: bytes, prefix: str) -> bytes:
    """A Prometheus text exposition with its ``tandem:`` families named ``prefix:`` (names only: a label value that
    says ``tandem:`` is left as it is)."""
    if prefix == "tandem":
        return exposition
    return _FAMILY.sub(rb"\1" + prefix.encode() + b":", exposition)
