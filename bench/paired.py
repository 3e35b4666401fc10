"""Ratios of two stacks' closed-loop loads taken pass by pass. The REST benches interleave their stacks' loads
(``pass_order``), so a pass's loads of two stacks ran seconds apart while passes ran minutes apart;
this host's pace drifts by 20-40 % between passes, so the ratio of two stacks' means carries that drift, and the
per-pass ratio, taken between neighbours in time, much less of it. Reported beside the means: the geometric mean of
the per-pass ratios, their lowest and highest, and a 95 % confidence interval of that geometric mean (Student's t over
the ratios' logarithms): whether a goal such as 0.97 is met, missed, or not decided by this many passes."""

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


# Student's t at 0.975 for 1..30 degrees of freedom (beyond, 30's: a little wider than the exact value)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired_ratio(a: list[float], b: list[float]) -> dict:
    """Pass k's ``a[k] / b[k]``, summarised: {"geomean", "low", "high", "passes", "ci95"}; ``ci95``: [lower, upper] of
    the geometric mean (None from one pass)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples must be as many and some: {len(a)} against {len(b)}")
    logs = [math.log(x / y) for x, y in zip(a, b)]
    n, mean = len(logs), sum(logs) / len(logs)
    ci95 = None
    if n > 1:
        half = _T975[min(n - 1, len(_T975)) - 1] * math.sqrt(sum((v - mean) ** 2 for v in logs) / (n - 1) / n)
        ci95 = [math.exp(mean - half), math.exp(mean + half)]
    return {"geomean": math.exp(mean), "low": math.exp(min(logs)), "high": math.exp(max(logs)), "passes": n,
            "ci95": ci95}


def ci_text(ratio: dict) -> str:
    """``ratio``'s interval as a report prints it: " (95 % CI 0.800-1.100)", or nothing from one pass."""
    ci = ratio.get("ci95")
    return f" (95 % CI {ci[0]:.3f}-{ci[1]:.3f})" if ci else ""


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
