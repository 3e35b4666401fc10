"""The verifier's Prometheus metrics (vLLM/SGLang-style names, prefixed ``tandem:``). The families the gateway
also has are labelled as the gateway's are: ``model_name`` (added at collection, so no call site passes it) and a
finished request's ``finished_reason`` (vLLM's label); so are vLLM's ``kv_cache_usage_perc``, ``num_preemptions`` and
speculative-decoding counters. The verifier's own families keep the labels scrapers already read (bench/, soak)."""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from tandem import metrics_port
from tandem.bulk_histogram import BulkHistogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


# The families that carry model_name: the gateway's too, and vLLM's queue, KV usage, preemptions, prefix cache and
# speculative-decoding counters (vLLM's dashboards select every panel by model_name)
MODEL_LABELLED = {"tandem:num_requests_running", "tandem:num_requests_waiting", "tandem:prompt_tokens", "tandem:generation_tokens",
                  "tandem:request_success", "tandem:time_to_first_token_seconds", "tandem:inter_token_latency_seconds",
                  "tandem:kv_cache_usage_perc", "tandem:num_preemptions", "tandem:prefix_cache_queries",
                  "tandem:prefix_cache_hits", "tandem:prefix_cache_evictions", "tandem:spec_decode_num_drafts",
                  "tandem:spec_decode_num_draft_tokens", "tandem:spec_decode_num_accepted_tokens",
                  "tandem:spec_decode_num_accepted_tokens_per_pos"}


class _WithLabels:
    """A collector that yields another registry's families, ``labels`` added to every sample of ``families``."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str], families: set[str]):
        self.inner, self.labels, self.families = inner, labels, families

    def collect(self):
        for family in self.inner.collect():
            if family.name not in self.families:
                yield family
                continue
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
            yield out


class VerifierMetrics:
    def __init__(self, max_positions: int = 16, model_name: str = ""):
        r = CollectorRegistry()  # what the metrics below record into; ``registry`` is what a scrape reads
        self.registry = CollectorRegistry()
        self.registry.register(_WithLabels(r, {"model_name": model_name}, MODEL_LABELLED))
        self.running = Gauge("tandem:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("tandem:num_requests_waiting", "Requests queued for admission", registry=r)
        self.batch_size = Histogram("tandem:iteration_batch_size", "Requests per engine step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prefilled prompt tokens", registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("tandem:request_success", "Finished requests by reason", ["finished_reason"],
                                registry=r)
        self.kv_usage = Gauge("tandem:kv_cache_usage_perc", "KV-cache usage (1 = every page in use; cached pages no "
                              "request holds are not in use)", registry=r)
        self.preemptions = Counter("tandem:num_preemptions", "Requests preempted (their KV freed, recomputed later); "
                                   "counted when seen waiting again or when the request ends", registry=r)
        # vLLM's pair (hit rate = hits / queries, in tokens), and the cached pages given back under pressure.
        self.prefix_cache_queries = Counter("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                            "cache", registry=r)
        self.prefix_cache_hits = Counter("tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                         "prefilled)", registry=r)
        self.prefix_cache_evictions = Counter("tandem:prefix_cache_evictions", "Cached KV pages evicted to make room",
                                              registry=r)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = BulkHistogram("tandem:inter_token_latency_seconds", "Time between streamed tokens (per token)",
                                 LATENCY_BUCKETS, r)
        self.num_drafts = Counter("tandem:spec_decode_num_drafts", "Verified draft trees", registry=r)
        self.draft_tokens = Counter("tandem:spec_decode_num_draft_tokens", "Verified draft tokens", registry=r)
        self.accepted_tokens = Counter("tandem:spec_decode_num_accepted_tokens", "Accepted draft tokens", registry=r)
        self.accepted_per_pos = Counter("tandem:spec_decode_num_accepted_tokens_per_pos",
                                        "Rounds accepting the draft token at each depth", ["position"], registry=r)
        self._children: dict = {}  # (labelled family, label) -> its child (_child)
        self.accept_length = BulkHistogram("tandem:spec_decode_accept_length", "Tokens per verify round (bonus "
                                           "included)", range(1, max_positions + 2), r)
        self.drafter_up = Gauge("tandem:drafter_up", "1 while the drafter is connected", registry=r)
        self.drafter_detached = Gauge("tandem:drafter_detached", "1 while the drafter is detached from a batch the "
                                      "policy keeps plain (its steps run target-only)", registry=r)
        self.drafter_round_lane = Gauge("tandem:drafter_round_lane", "1 while the drafter's rounds go on the round "
                                        "lane (a local socket), 0 on the gRPC stream or while disconnected", registry=r)
        self.drafter_failures = Counter("tandem:drafter_failures", "Drafter losses (timeouts, deaths)", registry=r)
        self.kv_pages_free = Gauge("tandem:kv_pages_free", "KV-cache pages an allocation can take: free, or in the "
                                   "prefix cache with no request holding them", registry=r)
        self.kv_pages_capacity = Gauge("tandem:kv_pages_capacity", "KV-cache pages that can be allocated", registry=r)
        self.phase_seconds = Histogram("tandem:round_phase_seconds", "Wall time per engine-step phase", ["phase"],
                                       buckets=LATENCY_BUCKETS, registry=r)

        # Where a service-pair round goes: the drafter's own work (as it reports it) and the rest of the
        # round trip (gRPC, thread hand-offs, ring publication): the boundary's price per round. Only
        # rounds sent and awaited in one go ("direct"); most rounds are prefetched, whose cost to the
        # engine is tandem:drafter_wait_seconds.
        round_buckets = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)
        self.drafter_round = Histogram("tandem:drafter_round_seconds", "Drafter round trip by part", ["part"],
                                       buckets=round_buckets, registry=r)
        # The drafter's part, split as it reports it: its extends, then its drafts (waiting for the GPU included).
        self.drafter_work = Histogram("tandem:drafter_work_seconds", "The drafter's work per round by phase", ["phase"],
                                      buckets=round_buckets, registry=r)
        self.drafter_rounds = Counter("tandem:drafter_rounds", "Drafter rounds by how they were sent: direct, "
                                      "prefetched (sent at the end of the previous step, its trees used) or "
                                      "prefetch_dropped (all its requests changed meanwhile) or flush (extends and "
                                      "releases alone, drafting nothing)", ["kind"], registry=r)
        # What a round costs the engine: the time it blocked for the reply. Below the round trip when the
        # Round went out early (prefetched at the end of the previous step) and the drafter worked meanwhile.
        self.drafter_wait = Histogram("tandem:drafter_wait_seconds", "Time the engine waited for the drafter per round",
                                      buckets=round_buckets, registry=r)

    def accepted_at(self, position: int):
        """The per-position acceptance counter's child for ``position`` (looked up once)."""
        return self._child(self.accepted_per_pos, str(position))

    def phase(self, name: str):
        """The step-phase histogram's child for ``name`` (looked up once)."""
        return self._child(self.phase_seconds, name)

    def finished(self, reason: str):
        """The finished-requests counter's child for ``reason`` (looked up once)."""
        return self._child(self.requests, reason)

    def _child(self, family, label: str):
        # (a family's ``labels`` takes its lock and builds the key: ~2 % of a served engine thread, every step)
        child = self._children.get((family, label))
        if child is None:
            child = self._children[(family, label)] = family.labels(label)
        return child

    def observe_drafter_round(self, round_trip_s: float, wait_s: float, drafts, kind: str = "direct") -> None:
        """One round as the verifier saw it (from the Round's send to its reply's receipt, and the part the
        engine spent waiting), the drafter's own split of its work (a Drafts message), and how it was sent."""
        self._child(self.drafter_rounds, kind).inc()
        self.drafter_wait.observe(max(wait_s, 0.0))
        drafter_s = min(max(drafts.draft_seconds, 0.0), round_trip_s)  # the drafter's word, kept plausible
        extend_s = min(max(drafts.extend_seconds, 0.0), drafter_s)
        self._child(self.drafter_work, "extend").observe(extend_s)
        self._child(self.drafter_work, "draft").observe(drafter_s - extend_s)
        if kind == "direct":  # a prefetched round's trip also holds the engine's own work after the send
            self._child(self.drafter_round, "drafter").observe(drafter_s)
            self._child(self.drafter_round, "boundary").observe(round_trip_s - drafter_s)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        metrics_port.serve(self.registry, port, host)


class StepTally:
    """A step's generated tokens and speculative rounds, added up over its outputs and put into the metrics once: a
    counter's increment takes a lock and a position's label a lookup, per output and round ~4 µs an output of a run
    of 3 rounds on the CPU VM, in the engine thread's every step."""

    def __init__(self):
        self.tokens = self.drafts = self.draft_tokens = self.accepted = 0
        self.lengths: collections.Counter = collections.Counter()  # accept length (the bonus token included) -> rounds
        self.reached: collections.Counter = collections.Counter()  # draft position -> rounds that accepted it

    def add(self, out) -> None:
        """One output (a StepOutput): its tokens, and its rounds where it speculated (a run of rounds: --spec-rounds)."""
        self.tokens += len(out.new_token_ids)
        if out.drafted:
            self.drafts += len(out.round_accepts)
            self.draft_tokens += out.drafted
            self.accepted += out.accepted
            for accepted in out.round_accepts:
                self.lengths[accepted + 1] += 1
                for position in range(accepted):
                    self.reached[position] += 1

    def flush(self, m: VerifierMetrics) -> None:
        if self.tokens:
            m.generation_tokens.inc(self.tokens)
        if not (self.drafts or self.draft_tokens):
            return
        m.num_drafts.inc(self.drafts)
        m.draft_tokens.inc(self.draft_tokens)
        m.accepted_tokens.inc(self.accepted)
        for length, rounds in self.lengths.items():
            m.accept_length.observe(length, rounds)
        for position, rounds in self.reached.items():
            m.accepted_at(position).inc(rounds)

