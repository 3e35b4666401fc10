"""A Prometheus histogram filled in bulk by one writer: ``observe(value, count)`` adds one value ``count`` times.

The verifier's engine observes the inter-token gap once per streamed token and the accept length once per round; through
prometheus_client's Histogram (a lock and a bucket search each) those observations and their label lookups were a
visible share of a served step's host time on a small target (py-spy: docs/benchmarks.md). A step's tokens of one
request share one gap, so here they are one call; the gateway's event loop, a message's tokens. One writer (the
engine loop's thread, the gateway's loop); a scrape reads a copy of the counts, which at most misses the observation
in flight. Exposed as prometheus_client exposes a Histogram (cumulative ``le`` buckets, ``_count``, ``_sum``), with
constant ``labels`` where given, without ``_created``."""

from __future__ import annotations

import bisect
import itertools
import math

from prometheus_client.metrics_core import HistogramMetricFamily


class BulkHistogram:
    def __init__(self, name: str, documentation: str, buckets, registry, labels: dict[str, str] | None = None):
        bounds = [float(b) for b in buckets]
        self.name, self.documentation = name, documentation
        self.labels = dict(labels or {})  # the same on every sample (the gateway's model_name)
        self.bounds = bounds + ([] if bounds and bounds[-1] == math.inf else [math.inf])
        self.counts = [0] * len(self.bounds)  # per bucket (not cumulative)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))]

    def collect(self):
        counts, total, buckets = list(self.counts), self.sum, []
        for bound, n in zip(self.bounds, itertools.accumulate(counts)):
            buckets.append(("+Inf" if bound == math.inf else repr(bound), n))
        if not self.labels:
            yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)
            return
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), buckets, total)
        yield family

