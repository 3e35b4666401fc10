"""Which buckets runs in one graph are captured at (RunGraphs.buckets): those whose plain decode step the device runs
within RUN_GRAPH_MAX_STEP_S, timed from the smallest up and no further than the first over it (a larger batch is
no faster; a many-layer target's decode graphs were timed at every bucket to capture none)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tandem.engine.graph_buffers import GraphFamily
from tandem.engine.run_graphs import RUN_GRAPH_MAX_STEP_S, RunGraphs


def _runs(step_ms: dict[int, float]) -> tuple[RunGraphs, list[int]]:
    graphs = SimpleNamespace(buckets=[1, 2, 3, 4, 5, 6, 7, 8, 16], device=torch.device("cpu"), use_graphs=True,
                             runner=SimpleNamespace(model_cfg=SimpleNamespace(vocab_size=32)))
    plain = GraphFamily(1, 16, 4, 16, torch.device("cpu"), captures=False)
    runs = RunGraphs(graphs, plain, None, steps=4)
    timed = []

    def step_seconds(fam, bs):
        timed.append(bs)
        return step_ms[bs] / 1e3

    runs.step_seconds = step_seconds
    return runs, timed


def test_buckets_are_timed_up_to_the_first_over_the_limit():
    limit_ms = 1e3 * RUN_GRAPH_MAX_STEP_S
    runs, timed = _runs({bs: limit_ms * (0.5 + 0.2 * bs) for bs in range(1, 9)})  # over from bucket 3 on
    member = next(iter(runs.families))
    assert runs.buckets(member) == [1, 2]
    assert timed == [1, 2, 3]
    assert runs.buckets(member) == [1, 2] and timed == [1, 2, 3]  # (asked again: not timed again)


def test_a_target_slow_at_one_row_times_one_bucket_a_member_and_runs_none():
    runs, timed = _runs({bs: 2.1 for bs in range(1, 9)})
    assert all(runs.buckets(member) == [] for member in runs.families)
    assert timed == [1] * len(runs.families)  # (RunGraphs caches its timings per family; this stand-in times again)


def test_twins_are_kept_unless_one_rank_times_a_long_step():
    """TargetGraphRunner._twins_pay: the decode step with features timed at one row decides, on one GPU rank; several
    ranks keep the twins without timing (each rank's own timing could keep different families, whose collectives would
    not pair), and so do graphs off the GPU."""
    from tandem.engine.cuda_graph import TargetGraphRunner

    def pays(step_s: float, tp_size: int = 1, device: str = "cuda", use_graphs: bool = True) -> bool:
        timed = []
        runs = SimpleNamespace(step_seconds=lambda fam, bs: timed.append((fam, bs)) or step_s)
        graphs = SimpleNamespace(use_graphs=use_graphs, device=torch.device(device), families={1: "featured"},
                                 runner=SimpleNamespace(cfg=SimpleNamespace(tp_size=tp_size)), run_graphs=runs)
        verdict = TargetGraphRunner._twins_pay(graphs)
        assert timed == ([("featured", 1)] if tp_size == 1 and device == "cuda" and use_graphs else [])
        return verdict

    assert pays(0.2 * RUN_GRAPH_MAX_STEP_S) and not pays(4 * RUN_GRAPH_MAX_STEP_S)
    assert pays(4 * RUN_GRAPH_MAX_STEP_S, tp_size=2) and pays(4 * RUN_GRAPH_MAX_STEP_S, device="cpu")
    assert pays(4 * RUN_GRAPH_MAX_STEP_S, use_graphs=False)
