"""The drafter service's own Prometheus metrics (``--metrics-port``): what it served, as it saw it. The
verifier's ``tandem:drafter_*`` metrics are the other side (round trips, the drafter's reported work);
these are the drafter's: rounds and their time here, the tokens its head took in, trees drafted, whether a
verifier is connected, reloads, and the head's own prefix cache (tandem.prefix_cache: the pages of its KV
that requests on a cached target prefix start on)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from tandem import metrics_port

ROUND_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class DrafterMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.rounds = Counter("tandem:drafter_served_rounds", "Rounds served, by kind: drafts (extend + draft "
                              "trees) or chain_run (a run of rounds queued on the device)", ["kind"], registry=r)
        self.round_seconds = Histogram("tandem:drafter_served_round_seconds", "Host time of a round here, by kind",
                                       ["kind"], buckets=ROUND_BUCKETS, registry=r)
        self.extend_tokens = Counter("tandem:drafter_extend_tokens", "Tokens (with their target features) the "
                                     "head took in", registry=r)
        self.trees = Counter("tandem:drafter_trees", "Draft trees drafted (one per request per round)", registry=r)
        self.verifier_connected = Gauge("tandem:drafter_verifier_connected", "1 while a verifier's Rounds stream is "
                                        "open", registry=r)
        self.reloads = Counter("tandem:drafter_reloads", "Reload calls, by result: loaded or refused", ["result"],
                               registry=r)

    def watch_prefix_cache(self, stats: Callable[[], object]) -> None:
        """Export the serving head's prefix-cache counts (a PrefixCacheStats, read at each scrape)."""
        self.registry.register(_PrefixCacheCounts(stats))

    def watch_shed(self, total: Callable[[], int]) -> None:
        """Export how many requests the serving head's KV pool could not hold (tandem.speculative.head_room)."""
        self.registry.register(_ShedCount(total))

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        metrics_port.serve(self.registry, port, host)


class _PrefixCacheCounts:
    """The serving head's PrefixCacheStats as counters (a reload starts a new head: they restart from 0)."""

    def __init__(self, stats: Callable[[], object]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        for name, value, doc in (("queries", s.queries, "Prompt tokens looked up in the head's prefix cache"),
                                 ("hits", s.hits, "Of those, tokens whose head KV was cached"),
                                 ("evictions", s.evictions, "Cached head KV pages evicted")):
            yield CounterMetricFamily(f"tandem:drafter_prefix_cache_{name}", doc, value=value)


class _ShedCount:
    def __init__(self, total: Callable[[], int]):
        self.total = total

    def collect(self):
        yield CounterMetricFamily("tandem:drafter_requests_shed", "Requests the head's KV cache could not hold: they "
                                  "verify without drafts (raise --max-kv-tokens; a reload starts it from 0)",
                                  value=self.total())
