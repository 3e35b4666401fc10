"""tandem.bulk_histogram against prometheus_client's own Histogram: the same observations (values on the bucket
bounds, beyond the last, one value observed many times at once) give the same exposed samples."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from tandem.bulk_histogram import BulkHistogram
from verifier.metrics import LATENCY_BUCKETS


def _samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect()
            for s in family.samples if not s.name.endswith("_created")}


@pytest.mark.parametrize("labels", [None, {"model_name": "tiny"}])
def test_bulk_observations_expose_what_prometheus_histogram_does(labels):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    bulk = BulkHistogram("tandem:gap_seconds", "a gap", LATENCY_BUCKETS, ours, labels=labels)
    reference = Histogram("tandem:gap_seconds", "a gap", list(labels or ()), buckets=LATENCY_BUCKETS, registry=theirs)
    if labels:
        reference = reference.labels(**labels)
    rng = random.Random(3)
    values = [*LATENCY_BUCKETS, 0.0, 45.0] + [rng.expovariate(50.0) for _ in range(200)]
    for value in values:
        count = rng.choice((1, 1, 4, 12))
        bulk.observe(value, count)
        for _ in range(count):
            reference.observe(value)
    got, want = _samples(ours), _samples(theirs)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), (key, got[key], value)
