"""--profile-rounds: the drafter traces the rounds after its warm-up and writes a Chrome trace; a
drafter stopped mid-trace writes what it has; a trace that cannot be written costs nothing else."""

from __future__ import annotations

import json
import logging

import torch

from drafter.profiling import RoundProfiler


def rounds(profiler: RoundProfiler, n: int, active_from: int | None = None, active_to: int | None = None) -> None:
    x = torch.randn(64, 64)
    try:
        for i in range(n):
            if active_from is not None:
                assert profiler.active == (active_from <= i < active_to)
            x = torch.tanh(x @ x)  # a round's work
            profiler.round_done()
    finally:
        profiler.close()  # never leave the profiler running: the process would crash at exit


def test_the_profiler_traces_the_rounds_after_the_warm_up_and_writes_a_trace(tmp_path, caplog):
    profiler = RoundProfiler(3, str(tmp_path / "traces"), skip=2)
    with caplog.at_level(logging.INFO, logger="drafter.profiling"):
        rounds(profiler, 7, active_from=2, active_to=5)  # rounds 3..5 are traced (the warm-up's 2 are not)
    traces = list((tmp_path / "traces").glob("drafter-rounds-*.json"))
    assert len(traces) == 1
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert "aten::mm" in names and "aten::tanh" in names
    assert "trace of 3 rounds" in caplog.text and "aten::mm" in caplog.text


def test_a_drafter_stopped_mid_trace_writes_what_it_has(tmp_path, caplog):
    profiler = RoundProfiler(100, str(tmp_path), skip=2)
    with caplog.at_level(logging.INFO, logger="drafter.profiling"):
        rounds(profiler, 6)  # the trace started at round 2 and is still running at the end: close() ends it
    assert not profiler.active and len(list(tmp_path.glob("drafter-rounds-*.json"))) == 1
    assert "trace of 4 rounds" in caplog.text


def test_a_trace_that_cannot_be_written_is_logged_and_given_up(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    profiler = RoundProfiler(2, str(tmp_path / "file" / "traces"), skip=1)  # a folder under a file
    with caplog.at_level(logging.ERROR, logger="drafter.profiling"):
        rounds(profiler, 5)  # no exception reaches the rounds
    assert not profiler.active and "profiling failed" in caplog.text


def test_off_it_never_starts(tmp_path):
    profiler = RoundProfiler(0, str(tmp_path))
    for _ in range(100):
        profiler.round_done()
        assert not profiler.active
    assert not list(tmp_path.iterdir())
