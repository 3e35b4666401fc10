"""A prompt that arrives while a run of decode steps is in flight (prompts apart, graphs) has its forward queued behind
that run before the run is read back (tandem.engine.prompts_behind): one engine step commits the run's tokens and the
prompt's first token, the device never waits on the host between them, and every request's tokens stay those of
one-step decoding, greedy and seeded-sampled, with every page back. Replays are stood in by their static code run
eagerly (tests/helpers.static_target_graphs)."""

from __future__ import annotations

import pytest
import torch

from test_graph_static_path import engine, pytestmark  # noqa: F401 - (a tiny Llama; the Triton interpreter's skip)


@pytest.fixture
def calls(engine, monkeypatch):
    """The order of runs queued ("queue", run id), read back ("read", run id), verify forwards launched
    ("forward", prompts, waited for at launch) and waits for the device ("wait",)."""
    import tandem.engine.decode_ahead as decode_ahead

    log, queue, read, launch = [], decode_ahead.queue_decode_steps, decode_ahead.read_decode_steps, engine.verify_launch

    def queued(executor, reqs, steps, after=None, **kw):
        run = queue(executor, reqs, steps, after, **kw)
        log.append(("queue", id(run)))
        return run

    monkeypatch.setattr(decode_ahead, "queue_decode_steps", queued)
    monkeypatch.setattr(decode_ahead, "read_decode_steps",
                        lambda runner, run: log.append(("read", id(run))) or read(runner, run))
    monkeypatch.setattr(engine, "verify_launch", lambda sched, width, timer, sync=True: log.append(
        ("forward", len(sched.prefill), sync)) or launch(sched, width, timer, sync))
    wait = engine.executor.synchronize
    monkeypatch.setattr(engine.executor, "synchronize", lambda: log.append(("wait",)) or wait())
    return log


def test_a_prompt_arriving_during_a_run_is_prefilled_behind_it_before_it_is_read_back(engine, calls, monkeypatch):
    from helpers import TorchGraphBackend, static_target_graphs
    from tandem.sampling import SamplingParams

    runner = engine.executor.runner
    monkeypatch.setattr(runner, "graph_backend", TorchGraphBackend(), raising=False)
    graphs = static_target_graphs(runner, widths=(1,), max_bs=4)
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (7, 10, 5)]
    params = [SamplingParams(max_new_tokens=26, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=7, max_new_tokens=26, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=8, max_new_tokens=21, ignore_eos=True)]
    engine.decode_steps = 1
    reference = [r.output_token_ids for r in engine.generate(prompts, params)]  # eager, one step at a time
    monkeypatch.setattr(engine, "prefill_apart", True)
    monkeypatch.setattr(engine.accounting, "prefill_apart", True)
    runner.graphs, engine.decode_steps = graphs, 4
    try:
        rids = [engine.add_request(p, sp) for p, sp in zip(prompts[:2], params[:2])]
        for _ in range(4):
            engine.step()
        in_flight = engine.run_in_flight
        assert in_flight is not None  # runs overlap while no prompt waits
        rids.append(engine.add_request(prompts[2], params[2]))
        calls.clear()
        outputs = engine.step()
        # the prompt's forward was queued (not waited for) before the run in flight was read back, and waited for
        # after it, in this one step, which committed both: the run's tokens and the prompt's first
        assert calls[:3] == [("forward", 1, False), ("read", id(in_flight)), ("wait",)], calls
        assert {out.rid for out in outputs} == set(rids)
        assert engine.last_step.num_prefill == 1 and not engine.last_step.num_decode  # counted as prompts alone
        assert engine.accounting.after_prompts and engine.run_in_flight is None
        while engine.has_unfinished():
            engine.step()
        result = [engine.requests.pop(rid).output for rid in rids]
    finally:
        runner.graphs, engine.decode_steps = None, 1
    assert result == reference
    assert engine.allocator.num_free == engine.allocator.capacity_pages


def test_prompts_wait_behind_a_run_while_decoding_is_owed(engine, calls, monkeypatch):
    """While decoding is owed after a step of prompts (prompts_due), an arrival is not prefilled behind the run in
    flight: the running requests first decode as long as the prompts took; once nothing is owed it is."""
    from helpers import TorchGraphBackend, static_target_graphs
    from tandem.sampling import SamplingParams

    runner = engine.executor.runner
    monkeypatch.setattr(runner, "graph_backend", TorchGraphBackend(), raising=False)
    graphs = static_target_graphs(runner, widths=(1,), max_bs=4)
    monkeypatch.setattr(engine, "prefill_apart", True)
    monkeypatch.setattr(engine.accounting, "prefill_apart", True)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    runner.graphs, engine.decode_steps = graphs, 4
    try:
        engine.add_request([5, 6, 7, 8, 9], params)
        for _ in range(3):
            engine.step()
        assert engine.run_in_flight is not None
        engine.add_request([21, 22, 23, 24], params)
        engine.accounting.decode_owed_s = 10.0  # (on the CPU a step's time is no measure: owed for the whole test)
        calls.clear()
        engine.step()
        assert engine.run_in_flight is not None and engine.scheduler.waiting  # the run read back, the next queued
        assert not any(call[0] == "forward" for call in calls), calls
        engine.accounting.decode_owed_s = 0.0
        calls.clear()
        engine.step()
        assert calls[:2] == [("forward", 1, False), ("read", calls[1][1])] and not engine.scheduler.waiting, calls
        while engine.has_unfinished():
            engine.step()
    finally:
        runner.graphs, engine.decode_steps = None, 1
        for rid in list(engine.requests):
            engine.requests.pop(rid)
    assert engine.allocator.num_free == engine.allocator.capacity_pages


def test_prompts_go_behind_a_run_only_where_their_step_is_a_plain_target_forward():
    """Not with prompts mixed into decoding, runs not overlapped, the batch speculating, a drafter attached (prompts'
    features go to it), traffic capture, several ranks, or nothing due; otherwise the prompts are scheduled (their
    pages held back by the run's requests' run and next step) and launched unwaited."""
    from types import SimpleNamespace

    from tandem.engine.prompts_behind import launch_prompts_behind

    asked = []

    def stub(**changes):
        base = dict(prefill_apart=True, overlap_runs=True, speculating=False, traffic=None, decode_steps=4,
                    cfg=SimpleNamespace(tp_size=1), drafts=SimpleNamespace(keeping=lambda: False),
                    prompts_due=lambda: True,
                    accounting=SimpleNamespace(pace=SimpleNamespace(chunk_cap=lambda *a: 64)),
                    executor=SimpleNamespace(prefill_graph_width=0),
                    scheduler=SimpleNamespace(schedule=lambda width, decode, chunk_cap: asked.append(
                        (width(None), decode, chunk_cap)) or SimpleNamespace(prefill=["p"])),
                    verify_launch=lambda sched, width, timer, sync=True: ("launched", width, sync))
        base.update(changes)
        return SimpleNamespace(**base)

    for off in (dict(prefill_apart=False), dict(overlap_runs=False), dict(speculating=True), dict(traffic=object()),
                dict(drafts=SimpleNamespace(keeping=lambda: True)), dict(cfg=SimpleNamespace(tp_size=2)),
                dict(prompts_due=lambda: False)):
        assert launch_prompts_behind(stub(**off), 3, None) is None, off
    assert asked == []
    assert launch_prompts_behind(stub(), 3, None) == ("launched", 1, False)
    assert asked == [(4, False, 64)]  # the run's 3 steps and the next one held back
