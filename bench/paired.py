"""Ratios of two stacks' closed-loop loads taken pass by pass. The REST benches interleave their stacks' loads
(``pass_order``), so a pass's loads of two stacks ran seconds apart while passes ran minutes apart;
this host's pace drifts by 20-40 % between passes, so the ratio of two stacks' means carries that drift, and the
per-pass ratio, taken between neighbours in time, much less of it. Reported beside the means: the geometric mean of
the per-pass ratios, and their lowest and highest."""

from __future__ import annotations

import math


def pass_order(modes: list[str], k: int) -> list[str]:
    """The order of the stacks' loads in pass ``k``: the list turned by ``k // 2`` places, reversed on odd passes. Over
    2n passes (n stacks) each stack loads in every position equally often: where every odd pass only reversed the
    order, a middle stack of three was always in the middle, and the host's pace within a pass put it apart (the
    forty-sixth session's position bias)."""
    turn = (k // 2) % len(modes)
    order = modes[turn:] + modes[:turn]
    return order[::-1] if k % 2 else order


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


def detached_against_plain(policy: list[dict], plain: list[float], at_least: float = 0.95) -> dict | None:
    """The policy stack's passes whose engine ran with the drafter detached in at least ``at_least`` of its stats
    windows (``sample["engine"]["detached_share"]``: plain steps alone, no decision to speculate) against target-only's
    same passes: what the plain path costs apart from what the policy decided. None: no such pass."""
    pairs = [(s["tok_s"], t) for s, t in zip(policy, plain)
             if ((s.get("engine") or {}).get("detached_share") or 0.0) >= at_least]
    return paired_ratio([a for a, _ in pairs], [b for _, b in pairs]) if pairs else None
