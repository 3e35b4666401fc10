"""A Prometheus histogram the engine thread fills in bulk: ``observe(value, count)`` adds one value ``count`` times.

The engine observes the inter-token gap once per streamed token and the accept length once per round; through
prometheus_client's Histogram (a lock and a bucket search each) those observations and their label lookups were a
visible share of a served step's host time on a small target (py-spy: docs/benchmarks.md). A step's tokens of one
request share one gap, so here they are one call. One writer (the engine loop's thread); a scrape reads a copy of the counts, which
at most misses the observation in flight. Exposed as prometheus_client exposes a Histogram (cumulative ``le``
buckets, ``_count``, ``_sum``), without ``_created``."""

from __future__ import annotations

import bisect
import itertools
import math

from prometheus_client.metrics_core import HistogramMetricFamily


class BulkHistogram:
    def __init__(self, name: str, documentation: str, buckets, registry):
        bounds = [float(b) for b in buckets]
        self.name, self.documentation = name, documentation
        self.bounds = bounds + ([] if bounds and bounds[-1] == math.inf else [math.inf])
        self.counts = [0] * len(self.bounds)  # per bucket (not cumulative)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self):
        counts, total, buckets = list(self.counts), self.sum, []
        for bound, n in zip(self.bounds, itertools.accumulate(counts)):
            buckets.append(("+Inf" if bound == math.inf else repr(bound), n))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)

