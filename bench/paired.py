"""Ratios of two stacks' closed-loop loads taken pass by pass. The REST benches interleave their stacks' loads (the
order reversed every other pass), so a pass's loads of two stacks ran seconds apart while passes ran minutes apart;
this host's pace drifts by 20-40 % between passes, so the ratio of two stacks' means carries that drift, and the
per-pass ratio, taken between neighbours in time, much less of it. Reported beside the means: the geometric mean of
the per-pass ratios, and their lowest and highest."""

from __future__ import annotations

import math


def paired_ratio(a: list[float], b: list[float]) -> dict:
    """Pass k's ``a[k] / b[k]``, summarised: {"geomean", "low", "high", "passes"}."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples must be as many and some: {len(a)} against {len(b)}")
    ratios = [x / y for x, y in zip(a, b)]
    return {"geomean": math.exp(sum(math.log(r) for r in ratios) / len(ratios)), "low": min(ratios),
            "high": max(ratios), "passes": len(ratios)}


def versus_the_better(policy: list[float], always: list[float], plain: list[float]) -> dict:
    """The policy's load against the better of the same stack speculating always and target-only, pass by pass."""
    return paired_ratio(policy, [max(x, y) for x, y in zip(always, plain)])
