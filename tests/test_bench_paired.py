"""bench/paired.py: per-pass ratios of two stacks' loads, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from bench_modules import import_bench

(paired,) = import_bench("paired")


def test_a_pass_by_pass_ratio_cancels_a_drift_the_ratio_of_means_keeps():
    # the host runs 40 % slower in the second pass; within a pass the policy makes 0.9 of always
    always, policy = [1000.0, 600.0], [900.0, 540.0]
    got = paired.paired_ratio(policy, always)
    assert got == {"geomean": pytest.approx(0.9), "low": pytest.approx(0.9), "high": pytest.approx(0.9), "passes": 2,
                   "ci95": [pytest.approx(0.9), pytest.approx(0.9)]}
    # with a pass order that put the policy's load into the slow stretch, the ratio of means says otherwise
    assert sum([900.0, 360.0]) / sum(always) == pytest.approx(0.7875)
    assert paired.paired_ratio([900.0, 360.0], always)["geomean"] == pytest.approx(math.sqrt(0.9 * 0.6))


def test_against_the_better_of_always_and_target_only_pass_by_pass():
    got = paired.versus_the_better([110.0, 90.0], always=[100.0, 120.0], plain=[105.0, 80.0])
    assert got["geomean"] == pytest.approx(math.sqrt(110 / 105 * 90 / 120))
    assert (got["low"], got["high"]) == (pytest.approx(0.75), pytest.approx(110 / 105))


@pytest.mark.parametrize("passes", [2, 5, 12, 40])
def test_the_interval_is_students_t_over_the_ratios_logarithms(passes):
    """Against scipy's t interval of the log ratios (the pass counts cross the table's end at 30 degrees of freedom,
    where it keeps 30's value: never narrower than the exact interval)."""
    stats = pytest.importorskip("scipy.stats")
    rng = __import__("random").Random(passes)
    plain = [rng.uniform(15000, 22000) for _ in range(passes)]
    policy = [p * rng.uniform(0.84, 1.16) for p in plain]
    logs = [math.log(a / b) for a, b in zip(policy, plain)]
    mean, sem = sum(logs) / passes, stats.sem(logs)
    low, high = stats.t.interval(0.95, passes - 1, loc=mean, scale=sem)
    got = paired.paired_ratio(policy, plain)
    if passes <= 31:
        assert got["ci95"] == [pytest.approx(math.exp(low), rel=2e-4), pytest.approx(math.exp(high), rel=2e-4)]
    else:
        assert got["ci95"][0] < math.exp(low) < got["geomean"] < math.exp(high) < got["ci95"][1]
    assert paired.ci_text(got) == f" (95 % CI {got['ci95'][0]:.3f}-{got['ci95'][1]:.3f})"


def test_one_pass_has_no_interval():
    got = paired.paired_ratio([9.0], [10.0])
    assert got["ci95"] is None and paired.ci_text(got) == ""


def test_unpaired_samples_are_refused():
    with pytest.raises(ValueError, match="as many"):
        paired.paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="as many"):
        paired.paired_ratio([], [])


def test_the_policys_wholly_detached_passes_against_target_only():
    """Only the passes whose engine was detached in at least 95 % of its windows are paired (the plain path's own
    cost); a pass without an engine record, or mostly attached, is left out."""
    policy = [{"tok_s": 95.0, "engine": {"detached_share": 1.0}}, {"tok_s": 60.0, "engine": {"detached_share": 0.5}},
              {"tok_s": 88.0, "engine": {"detached_share": 0.96}}, {"tok_s": 70.0}]
    got = paired.detached_against_plain(policy, [100.0, 100.0, 80.0, 90.0])
    assert got["passes"] == 2 and got["geomean"] == pytest.approx(math.sqrt(0.95 * 1.1))
    assert paired.detached_against_plain(policy[1:2], [100.0]) is None


@pytest.mark.parametrize("modes", [["T", "O"], ["P", "T", "I"], ["a", "b", "c", "d"]])
def test_over_two_passes_a_stack_each_stack_loads_in_every_position_equally_often(modes):
    orders = [paired.pass_order(modes, k) for k in range(2 * len(modes))]
    assert all(sorted(order) == sorted(modes) for order in orders)
    for mode in modes:
        assert sorted(order.index(mode) for order in orders) == sorted(list(range(len(modes))) * 2), mode
    assert orders[:2] == [modes, modes[::-1]]  # (the first two passes: the order given, then reversed)
