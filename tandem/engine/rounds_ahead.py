"""The engine's side of speculative rounds queued ahead (tandem.speculative.chain_rounds): when to
queue several greedy chain rounds in one step, and how their tokens are committed and counted.

A run applies when every running request drafts a greedy chain of one setting with the in-process
drafter, nothing waits for admission, and no one (a traffic capture, a request with min_tokens to
honour) needs the host between rounds; other ranks of a tensor-parallel target follow each round's
verify on the device (TargetExecutor.round_followers); log-probabilities are recorded on the device at
each round's verify (RunLogprobs) and come back with the tokens. Its length is cut to what the
requests can use: rounds computed after the requests' expected ends (their recent tokens per round against
their tokens left) stay at most an eighth of the run's request-rounds, so a request near its end shortens a
small batch's run and not a large one's. Tokens stream a run at a time.

Runs overlap (``engine.overlap_runs``, on by default): a step that reads a run back first queues the
next one after it, from the device's state, so the GPU goes on while the host waits, commits and
returns; the next step reads that one back (queuing another if nothing changed). A step that finds
the batch changed — a prompt waiting, a request finished, aborted or no longer drafting — queues
nothing more and only reads the run in flight back; a finished request's rows of it are dropped.
"""

from __future__ import annotations

import math

from tandem.engine.request_sampling import RunLogprobs, needs_host_each_round
from tandem.engine.step import StepInfo, StepOutput, StepTimer
from tandem.speculative.chain_rounds import (LocalDraftSide, QueuedRun, chain_rounds_fit, end_chain_rounds,
                                             queue_chain_rounds, read_chain_rounds, target_rounds_fit)
from tandem.speculative.remote_rounds import RemoteDraftSide
from tandem.speculative.proposer import ProposerUnavailable


def rounds_ahead(engine) -> int:
    """Chain rounds to queue back to back this step, up to the engine's ``spec_rounds``; 0: none (the step
    drafts and verifies on the host). A run of one round is still worth queuing where prompts come apart
    (its rounds stay on the device: a round on the host does per-request work)."""
    running = engine.scheduler.running
    rounds = _run_length(engine, running, queued=0) if running else 0
    return rounds if rounds > 1 or (rounds == 1 and engine.prefill_apart) else 0


def _run_length(engine, reqs: list, queued: int) -> int:
    """Rounds of ``reqs`` that can be queued now, past ``queued`` rounds not read back yet (0: none)."""
    rounds = engine.spec_rounds
    if rounds <= 1 or engine.traffic is not None or not engine.drafts.up():
        return 0
    # a prompt comes in after one round (prompts apart), or in a mixed step; after prompts alone, one round (and the
    # run behind it queued before it is read back)
    if engine.prompts_due() or (engine.accounting.after_prompts and not queued):
        if queued or not engine.prefill_apart:
            return 0
        rounds = 1
    # While the policy has yet to learn the traffic's τ (its first rounds after start-up or new traffic), no more rounds
    # than it has left to learn: what they teach decides whether runs pay (a head that accepts nothing paid the runs
    # queued meanwhile at batch 64); alone, a request learns in runs, cheaper per round than rounds on the host.
    learning = engine.policy.learning_rounds_left()
    if learning:
        learning -= queued * len(reqs)  # (rounds queued and not read back yet teach it too)
        if learning <= 0:
            return 0
        rounds = min(rounds, math.ceil(learning / len(reqs)))
    spec = reqs[0].spec
    if spec is None or spec.topk != 1 or (queued and not engine.chain.settled(spec)):  # (the policy shortens it)
        return 0
    nd, context = spec.num_draft_tokens, engine.context_len
    wanted = []  # rounds each request is expected to use
    for req in reqs:
        if (req.spec != spec or not req.params.greedy or req.pending_extend or not req.draft_ready
                or engine.tree_width(req) != nd or needs_host_each_round(req, engine.processed_logprobs)):
            return 0
        recent = req.spec_state.recent
        per_round = max(1.0, recent.mean if recent is not None and recent.weight else 1.0)
        # tokens still wanted, after what the queued rounds are expected to emit
        left = req.params.max_new_tokens - len(req.output) - queued * per_round
        wanted.append(math.ceil(left / per_round))
        rounds = min(rounds, (context - req.num_tokens + 1) // nd - queued)  # every verify's positions inside the context
    rounds = _useful_run(rounds, wanted)
    # Reserving the worst case (every draft accepted) must not preempt anyone a one-round step would keep.
    while rounds >= 1 and (sum(req.kv.pages_needed(req.num_tokens - 1 + (queued + rounds) * nd) for req in reqs)
                           > engine.allocator.num_free):
        rounds -= 1
    if rounds < 1:
        return 0
    drafter, _ = _device_drafter(engine.proposer)
    rids, graphs = [req.rid for req in reqs], engine.executor.runner.graphs
    if drafter is None:  # a drafter process checks its own half when the run is announced
        return rounds if _remote_runs(engine.proposer) is not None and target_rounds_fit(graphs, len(reqs), spec) else 0
    while rounds >= 1 and not chain_rounds_fit(drafter, graphs, rids, spec, queued + rounds):
        rounds -= 1  # the drafter's pages or positions may still fit a shorter run
    return rounds


RUN_WASTE_SHARE = 0.125  # of a run's request-rounds, at most this share may fall after their requests' ends


def _useful_run(cap: int, wanted: list[int]) -> int:
    """The longest run up to ``cap`` rounds whose rounds past the requests' expected ends (``wanted``: rounds each
    is expected to use) are at most RUN_WASTE_SHARE of its request-rounds: in a large batch, a few requests near
    their end do not cut every other one's run to single rounds, each paying the host between rounds; alone, a
    request's run stops at its end."""
    for rounds in range(cap, 0, -1):
        if sum(max(0, rounds - w) for w in wanted) <= RUN_WASTE_SHARE * rounds * len(wanted):
            return rounds
    return 0


def _device_drafter(proposer):
    """→ (the in-process drafter whose rounds can run on the device, or None; the steering hook of the
    controlled-acceptance instrument, or None). Proposers name that drafter as ``rounds_drafter``."""
    from tandem.speculative.drafter import Eagle3Drafter

    drafter = proposer.rounds_drafter
    return (drafter if isinstance(drafter, Eagle3Drafter) else None), proposer.steer_on_device


def _remote_runs(proposer):
    """The drafter service's client, when its drafter can take its half of runs on the device
    (tandem.speculative.remote_rounds); else None."""
    return proposer if proposer.chain_runs_available else None


def _queue(engine, reqs: list, rounds: int, after: QueuedRun | None) -> QueuedRun | None:
    """Queue a run (None: the drafter process refused it; it then drafts round by round for a while)."""
    drafter, steer = _device_drafter(engine.proposer)
    graphs = engine.executor.runner.graphs
    if drafter is None:
        side = engine.proposer.queue_run([req.rid for req in reqs], reqs[0].spec, rounds, after is not None,
                                         [req.last_token for req in reqs])
        if side is None:
            return None
        rounds = side.rounds  # (fewer where the drafter's pages held only those; the target's extra pages go back)
        logprobs = RunLogprobs.of(reqs, rounds, engine.executor.runner.device, reqs[0].spec.num_draft_tokens)
        return queue_chain_rounds(graphs, side, reqs, reqs[0].spec, rounds, steer, after, logprobs,
                                  engine.executor.round_followers())
    logprobs = RunLogprobs.of(reqs, rounds, engine.executor.runner.device, reqs[0].spec.num_draft_tokens)
    # A proposer that guards its head (the verifier's in-process head) turns the head's recoverable
    # failures into ProposerUnavailable: the requests then go on without speculation, as after a loss.
    return engine.proposer.guarded(queue_chain_rounds, graphs, LocalDraftSide(drafter), reqs, reqs[0].spec, rounds,
                                   steer, after, logprobs, engine.executor.round_followers())


def _round_logprobs(run: QueuedRun, result) -> dict | None:
    """Per asking request, the entries of the nodes each round emitted from (nodes 0..count-1)."""
    if run.logprobs is None:
        return None
    index = {req.rid: i for i, req in enumerate(run.reqs)}
    return {rid: [e for r, nodes in enumerate(rounds) for e in nodes[: len(result.tokens[index[rid]][r])]]
            for rid, rounds in run.logprobs.read().items()}


def step_rounds_ahead(engine, reqs: list, rounds: int, timer: StepTimer) -> list[StepOutput]:
    """Queue a run of ``rounds`` rounds from the committed state, then read it back (as every later
    step reads the run in flight back: ``step_run_in_flight``)."""
    with timer("verify"):
        try:
            run = _queue(engine, reqs, rounds, None)
        except ProposerUnavailable as e:
            engine.drafts.lost(e)
            return []
    if run is None:  # refused by the drafter process: nothing ran; the next steps go round by round
        return []
    return _read_back(engine, run, timer, run.queued_ns)


def step_run_in_flight(engine, timer: StepTimer) -> list[StepOutput]:
    """A step that starts with a run queued and not read back: read it back (queuing the next first)."""
    run, engine.run_in_flight = engine.run_in_flight, None
    return _read_back(engine, run, timer)


def _read_back(engine, run: QueuedRun, timer: StepTimer, queued_ns: tuple[int, int] | None = None) -> list[StepOutput]:
    """Queue the next run after ``run`` where the batch allows, then wait for ``run``, commit its tokens
    and count each round that reached the output. ``queued_ns``: when this step queued ``run`` itself."""
    nd = run.spec.num_draft_tokens
    drafted = nd - 1
    queued_ahead = queued_ns is None
    live = [(i, req) for i, req in enumerate(run.reqs) if not req.finished]  # aborted since: nothing to commit
    following = None
    with timer("verify"):
        same_batch = engine.scheduler.running_exactly(run.reqs)
        more = _run_length(engine, run.reqs, queued=run.rounds) if engine.overlap_runs and same_batch else 0
        if more:
            for req in run.reqs:  # the target's pages for both runs (the drafter reserves its own)
                req.kv.reserve(req.num_tokens - 1 + (run.rounds + more) * nd)
            try:
                following = _queue(engine, run.reqs, more, run)
                if following is not None:
                    queued_ns = (queued_ns or following.queued_ns)[:1] + following.queued_ns[1:]
            except ProposerUnavailable as e:
                engine.drafts.lost(e)  # this run's tokens still come back (the pages past them go back below)
        if isinstance(run.side, RemoteDraftSide) and not run.side.wait_drafted(engine.proposer.deadline_s):
            for late in (run, following):  # never leave the device waiting on a drafter that is gone
                if late is not None:
                    late.side.release()
            engine.proposer.discard("the drafter did not queue its half of a run in time")
            engine.drafts.lost(ProposerUnavailable("the drafter did not queue its half of a run in time"))
        result = read_chain_rounds(engine.executor.runner.graphs, run)
    with timer("accept"):
        keep_pages = following is not None
        emitted = {req.rid: [t for toks in result.tokens[i] for t in toks] for i, req in live}
        engine.hold_finished_drafts()  # the drafter commits the run for requests it ends too
        try:
            outputs = engine.commit([req for _, req in live], emitted, {}, keep_pages=keep_pages,
                                    logprobs=_round_logprobs(run, result))
            end_chain_rounds(run, result, keep_pages)
        finally:
            engine.release_finished_drafts()
        for out, (i, req) in zip(outputs, live):
            per_round, speculative = result.tokens[i], result.speculative[i]
            committed = len(out.new_token_ids)
            for toks, counted in zip(per_round, speculative):  # a round counts when any of its tokens was kept
                if committed <= 0 or not counted:  # (after a broken draft: plain steps, as one round per step)
                    break
                committed -= len(toks)
                req.spec_stats.record(drafted, len(toks) - 1)
                engine.policy.observe_round(req.spec_state, len(toks), drafted)
                out.drafted += drafted
                out.round_accepts.append(len(toks) - 1)
        broken = [req for i, req in live if result.broken[i] and not req.finished]
        if broken:
            engine.drafts.broken_drafts(broken, "draft log-probs contain NaN; the draft head or its features are broken")
    if following is not None and all(req.finished for req in following.reqs):
        read_chain_rounds(engine.executor.runner.graphs, following)  # no one left to commit it to
        following = None
    engine.run_in_flight = following
    # "queue": inside "verify", the host's queuing of the rounds (the rest of "verify" waits for the GPU)
    engine.last_step = StepInfo(0, len(live), dict(timer.spans, **({"queue": queued_ns} if queued_ns else {})),
                                steps=run.rounds, speculative=True, width=nd, queued_ahead=queued_ahead)
    return outputs
