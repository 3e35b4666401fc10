"""bench/profile_deepseek.py's kernel table on a hand-made trace: each kernel's own span and its exposed time (how far
it moved the busy end past every earlier op's), which under programmatic dependent launch is the chain's time after
the kernel before; the exposed times sum to the busy time sections_profile._idle_gaps measures its own way."""

from __future__ import annotations

import json
import sys

import pytest
from bench_modules import import_bench


def _op(name, ts, dur, cat="kernel", grid=None):
    op = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if grid is not None:
        op["args"] = {"grid": grid}
    return op


def _profile_module():
    saved = list(sys.path)
    try:
        return import_bench("profile_deepseek", "sections_profile")
    finally:
        sys.path[:] = saved  # (profile_deepseek puts bench/ on the path for its own imports)


def test_exposed_times_are_the_chain_past_each_predecessor_and_sum_to_the_busy_time(tmp_path):
    pytest.importorskip("torch")
    profile, sections_profile = _profile_module()
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        _op("a", 0, 10),
        _op("b", 5, 12),  # launched early (PDL): waits until a ends at 10, ends at 17 -> 7 exposed
        _op("side", 6, 4),  # another stream, inside the busy span -> 0 exposed
        _op("c", 16, 10),  # ends at 26 -> 9 exposed
        _op("copy", 30, 2, "gpu_memcpy"),  # after an idle gap: busy, not a kernel
        _op("a", 33, 3),  # -> 3 exposed
        {"ph": "i", "name": "a marker"},
    ]}))
    rows, counts = profile._kernel_table(trace, tokens=1)
    by_name = {r["name"]: r for r in rows}
    assert {n: (r["us_per_token"], r["exposed_us_per_token"], r["calls_per_token"]) for n, r in by_name.items()} == {
        "a": (13, 13, 2), "b": (12, 7, 1), "side": (4, 0, 1), "c": (10, 9, 1)}
    assert counts == {"kernel": 5, "gpu_memcpy": 1, "gpu_memset": 0}
    busy_us = 1e3 * sections_profile._idle_gaps(trace, top=0)["busy_ms"]
    assert sum(r["exposed_us_per_token"] for r in rows) + 2 == pytest.approx(busy_us)


def test_one_kernels_launches_are_split_by_grid_with_their_median_span(tmp_path):
    """A GEMV kernel launched for two projections of different shapes: each grid's launches per token, the median span
    of one, and its exposed time."""
    pytest.importorskip("torch")
    profile, _ = _profile_module()
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        _op("gemv", 0, 9, grid=[768, 1, 1]),
        _op("gemv", 10, 26, grid=[3584, 1, 1]),
        _op("gemv", 40, 11, grid=[768, 1, 1]),
        _op("gemv", 60, 28, grid=[3584, 1, 1]),
        _op("gemv", 100, 30, grid=[3584, 1, 1]),
        _op("norm", 140, 2),
    ]}))
    rows, _ = profile._kernel_table(trace, tokens=2)
    by_name = {r["name"]: r for r in rows}
    shapes = {s["grid"]: (s["calls_per_token"], s["median_us"], s["exposed_us_per_token"])
              for s in by_name["gemv"]["launch_shapes"]}
    assert shapes == {"[3584, 1, 1]": (1.5, 28, 42), "[768, 1, 1]": (1, 10, 10)}
    assert [s["grid"] for s in by_name["gemv"]["launch_shapes"]] == ["[3584, 1, 1]", "[768, 1, 1]"]
    assert by_name["norm"]["launch_shapes"] == [{"grid": "?", "calls_per_token": 0.5, "us_per_token": 1,
                                                 "median_us": 2, "exposed_us_per_token": 1}]
