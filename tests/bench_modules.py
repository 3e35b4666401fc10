"""What the CPU smoke tests of bench/ sections share: importing bench/ modules by their plain names (as they
import each other) without leaving bench/ on the path, and a wall-clock stand-in for the GPU timers."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[1] / "bench")


def import_bench(*names: str) -> list:
    """The named bench/ modules; no other test may pick up a bench/ module by its name afterwards."""
    sys.path.insert(0, BENCH)
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(BENCH)


def wall_ms(calls, reps: int = 1) -> float:
    """Milliseconds per call of ``calls`` by the wall clock (the sections' graph_ms / events_ms on a CPU)."""
    started = time.perf_counter()
    for call in calls:
        call()
    return 1e3 * (time.perf_counter() - started) / len(calls)
