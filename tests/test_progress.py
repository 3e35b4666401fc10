"""The progress line of long work (tandem.training.progress): its ETA comes from the steps after the first, which pays
one-off costs (torch.compile's minute and more), not from the first step's time spread over the rest."""

from __future__ import annotations

import io

from tandem.training import progress


def test_the_eta_leaves_out_the_first_steps_one_off_cost(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    out = io.StringIO()
    bar = progress.Progress("eagle3", 101, stream=out, every_s=0.0)
    clock[0] = 90.0  # the first step compiles: 90 s
    bar.update(1, tokens=100)
    assert "ETA ?" in out.getvalue().splitlines()[-1]  # (one step, its time all compilation: no ETA yet)
    clock[0] = 100.0  # then 1 s a step
    bar.update(11, tokens=1000)
    line = out.getvalue().splitlines()[-1]
    assert "ETA 1m30s" in line and "100 tok/s" in line, line  # 90 steps left at 1 s each; 1000 tokens in 10 s
