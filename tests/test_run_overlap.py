"""Runs of chain rounds overlap (tandem.engine.rounds_ahead): a step queues the next run from the
device's state before it reads the last one back. The tokens and the acceptance per round must be
what runs read back one at a time give (and target-only greedy decoding), and a batch that changes
while a run is in flight — a prompt arriving, a request aborted — must lose nothing and leak no page.
Replays are stood in by their static code run eagerly, as in test_chain_rounds."""

from __future__ import annotations

import pytest
import torch

import tandem.engine.rounds_ahead as rounds_ahead
from tandem.sampling import SamplingParams
from test_chain_rounds import NEW_TOKENS, _all_pages_free, _run, engine, pair, pytestmark  # noqa: F401


@pytest.fixture
def calls(monkeypatch):
    """The order of the engine's queue and read-back calls: ("queue", run id, id of the run it follows
    or None) and ("read", run id)."""
    log, queue, read = [], rounds_ahead.queue_chain_rounds, rounds_ahead.read_chain_rounds

    def queued(graphs, drafter, reqs, spec, rounds, steer=None, after=None, *rest):
        run = queue(graphs, drafter, reqs, spec, rounds, steer, after, *rest)
        log.append(("queue", id(run), None if after is None else id(after)))
        return run

    def read_back(graphs, run):
        log.append(("read", id(run)))
        return read(graphs, run)

    monkeypatch.setattr(rounds_ahead, "queue_chain_rounds", queued)
    monkeypatch.setattr(rounds_ahead, "read_chain_rounds", read_back)
    return log


def test_the_next_run_is_queued_before_the_last_is_read_back_and_changes_nothing(engine, pair, calls):
    _, prompts, ref = pair
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engine.overlap_runs = False
    apart, accepted_apart, _ = _run(engine, prompts, params, 4, ref, rate=0.3)
    assert all(call[0] == "read" or call[2] is None for call in calls)  # nothing queued after an unread run
    calls.clear()
    # Another batch's block tables are what the static buffers hold past a run's pages (here: the dummy
    # page): a following run must stage the pages reserved for it, not find them there by chance.
    for fam in engine.executor.runner.graphs.families.values():
        fam.block_tables.zero_()
    engine.proposer.graphs.block_tables.zero_()
    engine.overlap_runs = True
    overlapped, accepted_overlapped, _ = _run(engine, prompts, params, 4, ref, rate=0.3)
    assert apart == ref and overlapped == ref
    assert accepted_overlapped == accepted_apart  # the device state a run goes on from is the right one
    follows = [(run, after) for kind, run, *rest in calls if kind == "queue" for after in rest if after is not None]
    assert len(follows) >= 2
    for run, after in follows:  # each following run was queued before the run it follows was read back
        assert calls.index(("queue", run, after)) < calls.index(("read", after))
    assert engine.run_in_flight is None and _all_pages_free(engine)


def test_a_prompt_arriving_while_a_run_is_in_flight_waits_for_it_and_loses_nothing(engine, pair):
    _, prompts, ref = pair
    engine.spec_rounds = 4
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    first = engine.add_request(prompts[1], params)
    engine.step()  # the prefill
    engine.step()  # a run read back, the next in flight
    assert engine.run_in_flight is not None
    second = engine.add_request(prompts[2], params)
    engine.step()  # reads the run in flight back and queues nothing after it: a prompt waits
    assert engine.run_in_flight is None and engine.scheduler.waiting
    while engine.has_unfinished():
        engine.step()
    assert [engine.requests.pop(rid).output for rid in (first, second)] == [ref[1], ref[2]]
    assert _all_pages_free(engine)


def test_after_prompts_alone_the_round_owed_goes_with_the_next_run_queued_behind_it(engine, pair, calls, monkeypatch):
    """Prompts apart: right after a step of prompts alone the speculating requests take one round, queued as a run of
    one with the next run queued behind it before it is read back; nothing lost, every page back."""
    _, prompts, ref = pair
    monkeypatch.setattr(engine, "prefill_apart", True)
    monkeypatch.setattr(engine.accounting, "prefill_apart", True)
    engine.spec_rounds = 4
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    first = engine.add_request(prompts[1], params)
    for _ in range(3):  # the prefill, runs
        engine.step()
    second = engine.add_request(prompts[2], params)
    kinds = []
    while engine.has_unfinished():
        calls.clear()
        engine.step()
        kinds.append((engine.last_step.num_prefill, list(calls)))
    prompt_step = next(i for i, (prefilled, _) in enumerate(kinds) if prefilled)
    owed = kinds[prompt_step + 1][1]
    queued = [call for call in owed if call[0] == "queue"]
    assert len(queued) == 2, owed  # the round owed, and the run behind it
    (_, one, _), (_, following, after) = queued
    assert after == one and owed.index(("queue", following, one)) < owed.index(("read", one)), owed
    assert [engine.requests.pop(rid).output for rid in (first, second)] == [ref[1], ref[2]]
    assert engine.run_in_flight is None and _all_pages_free(engine)


@pytest.mark.parametrize("aborted", ["second", "first"])
def test_a_request_aborted_while_a_run_is_in_flight_gets_nothing_more(engine, pair, aborted):
    """The request left keeps its own row of the run's drafter snapshot (state, top-k), also when the
    aborted one came before it in the batch."""
    _, prompts, ref = pair
    engine.spec_rounds = 4
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    rids = [engine.add_request(prompts[0], params), engine.add_request(prompts[1], params)]
    (kept, k), (dropped, d) = ((rids[0], 0), (rids[1], 1)) if aborted == "second" else ((rids[1], 1), (rids[0], 0))
    engine.step()  # the prefills
    engine.step()  # a run read back, the next in flight
    run = engine.run_in_flight
    assert run is not None and [req.rid for req in run.reqs] == rids
    before = list(engine.requests[dropped].output)
    engine.abort(dropped)
    outputs = engine.step()
    assert dropped not in {out.rid for out in outputs} and engine.run_in_flight is None
    assert before == ref[d][: len(before)]
    state, top_logp, top_ids = run.snapshot
    left = engine.proposer.request_states([kept])[0]
    assert torch.equal(left.state, state[k]) and torch.equal(left.top_logp, top_logp[k])
    assert torch.equal(left.top_ids, top_ids[k])
    while engine.has_unfinished():
        engine.step()
    assert engine.requests.pop(kept).output == ref[k]
    assert _all_pages_free(engine)


def test_a_head_failure_queuing_the_next_run_costs_speculation_not_tokens(engine, pair, monkeypatch):
    """The verifier's guarded head (``--drafter in-process``) fails while the next run is queued after
    one in flight: the run in flight still comes back and is committed, the head lets go of every
    request (its pages too), and the request decodes on without speculation, to the same tokens."""
    from verifier.in_process_head import GuardedHead

    _, prompts, ref = pair
    drafter = engine.proposer
    engine.proposer, engine.spec_rounds = GuardedHead(drafter), 4
    failed = []

    def broken(reqs):
        failed.append(True)
        raise KeyError("the head lost a request")

    monkeypatch.setattr(drafter.graphs, "restage_pages", broken)  # only a run queued after another restages
    rid = engine.add_request(prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # a run queued from the committed state, the next one fails, the first is read back
    assert failed and engine.run_in_flight is None
    req = engine.requests[rid]
    assert not req.draft_ready and 1 <= req.spec_stats.rounds <= 4
    assert not drafter.has(rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.requests.pop(rid).output == ref[0]
    engine.proposer = drafter
    assert _all_pages_free(engine)
