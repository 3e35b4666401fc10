"""Timing host-side work (no GPU involved): the best of several runs, since the host's noise only adds."""

from __future__ import annotations

import time


def best_seconds(fn, repeat: int) -> float:
    """The shortest of ``repeat`` wall-clock timings of ``fn()``."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best
