"""--profile-rounds: the drafter traces the rounds after its warm-up and writes a Chrome trace."""

from __future__ import annotations

import json
import logging

import torch

from drafter.profiling import RoundProfiler


def test_the_profiler_traces_the_rounds_after_the_warm_up_and_writes_a_trace(tmp_path, caplog):
    profiler = RoundProfiler(3, str(tmp_path / "traces"), skip=2)
    x = torch.randn(64, 64)
    with caplog.at_level(logging.INFO, logger="drafter.profiling"):
        for i in range(7):
            assert profiler.active == (2 <= i < 5)  # rounds 3..5 are traced (the warm-up's 2 are not)
            x = torch.tanh(x @ x)  # a round's work
            profiler.round_done()
    traces = list((tmp_path / "traces").glob("drafter-rounds-*.json"))
    assert len(traces) == 1
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert "aten::mm" in names and "aten::tanh" in names
    assert "trace of 3 rounds" in caplog.text and "aten::mm" in caplog.text


def test_off_it_never_starts(tmp_path):
    profiler = RoundProfiler(0, str(tmp_path))
    for _ in range(100):
        profiler.round_done()
        assert not profiler.active
    assert not list(tmp_path.iterdir())
