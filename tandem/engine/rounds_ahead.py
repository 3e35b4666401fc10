"""The engine's side of speculative rounds queued ahead (tandem.speculative.chain_rounds): when to
queue several greedy chain rounds in one step, and how their tokens are committed and counted.

A run applies when every running request drafts a greedy chain of one setting with the in-process
drafter, nothing waits for admission, and no one (a traffic capture, other ranks) needs the host
between rounds. Its length is cut to what the requests can use: a request expected to finish in
fewer rounds (its recent tokens per round against its tokens left) shortens the run, so the rounds
computed after a request's end stay few. Tokens stream a run at a time.
"""

from __future__ import annotations

import math
import time

from tandem.engine.step import StepInfo, StepOutput, StepTimer
from tandem.speculative.chain_rounds import chain_rounds_fit, run_chain_rounds
from tandem.speculative.verify import ProposerUnavailable


def rounds_ahead(engine) -> int:
    """Chain rounds to queue back to back this step: up to the engine's ``spec_rounds``, else 1."""
    rounds, running = engine.spec_rounds, engine.scheduler.running
    if (rounds <= 1 or not running or engine.cfg.tp_size > 1 or engine.scheduler.waiting
            or engine.traffic is not None or not engine.drafts.up()):
        return 1
    spec = running[0].spec
    if spec is None or spec.topk != 1:
        return 1
    nd, context = spec.num_draft_tokens, engine.model_config.max_position_embeddings
    for req in running:
        if (req.spec != spec or not req.params.greedy or req.pending_extend or not req.draft_ready
                or engine._tree_width(req) != nd):
            return 1
        recent = req.spec_state.recent
        per_round = recent.mean if recent is not None and recent.weight else 1.0
        left = req.params.max_new_tokens - len(req.output)
        rounds = min(rounds, math.ceil(left / max(1.0, per_round)),
                     (context - req.num_tokens + 1) // nd)  # every verify's positions inside the context
    if rounds <= 1:
        return 1
    # Reserving the worst case (every draft accepted) must not preempt anyone a one-round step would keep.
    if sum(req.kv.pages_needed(req.num_tokens - 1 + rounds * nd) for req in running) > engine.allocator.num_free:
        return 1
    drafter, _ = _device_drafter(engine.proposer)
    if drafter is None:
        return 1
    rids, graphs = [req.rid for req in running], engine.executor.runner.graphs
    while rounds > 1 and not chain_rounds_fit(drafter, graphs, rids, spec, rounds):
        rounds -= 1  # the drafter's pages or positions may still fit a shorter run
    return rounds


def _device_drafter(proposer):
    """→ (the in-process drafter whose rounds can run on the device, or None; the steering hook of the
    controlled-acceptance instrument, or None). Proposers name that drafter as ``rounds_drafter``."""
    from tandem.speculative.drafter import Eagle3Drafter

    drafter = getattr(proposer, "rounds_drafter", None)
    return (drafter if isinstance(drafter, Eagle3Drafter) else None), getattr(proposer, "steer_on_device", None)


def step_rounds_ahead(engine, reqs: list, rounds: int, timer: StepTimer) -> list[StepOutput]:
    """Run the queued rounds, commit their tokens, and count each round that reached the output."""
    spec = reqs[0].spec
    drafted = spec.num_draft_tokens - 1
    started = time.perf_counter()
    with timer("verify"):
        drafter, steer = _device_drafter(engine.proposer)
        # A proposer that guards its head (the verifier's in-process head) turns the head's recoverable
        # failures into ProposerUnavailable: the requests then go on without speculation, as after a loss.
        guarded = getattr(engine.proposer, "guarded", lambda call, *args: call(*args))
        try:
            result = guarded(run_chain_rounds, engine.executor.runner.graphs, drafter, reqs, spec, rounds, steer)
        except ProposerUnavailable as e:
            engine.drafts.lost(e)
            return []
    with timer("accept"):
        emitted = {req.rid: [t for toks in per_round for t in toks] for req, per_round in zip(reqs, result.tokens)}
        outputs = engine._commit(reqs, emitted, {})
        for out, req, per_round, speculative in zip(outputs, reqs, result.tokens, result.speculative):
            committed = len(out.new_token_ids)
            for toks, counted in zip(per_round, speculative):  # a round counts when any of its tokens was kept
                if committed <= 0 or not counted:  # (after a broken draft: plain steps, as one round per step)
                    break
                committed -= len(toks)
                req.spec_stats.record(drafted, len(toks) - 1)
                engine.policy.observe_round(req.spec_state, len(toks))
                out.drafted += drafted
                out.round_accepts.append(len(toks) - 1)
        broken = [req for req, bad in zip(reqs, result.broken) if bad and not req.finished]
        if broken:
            engine.drafts.broken_drafts(broken, "draft log-probs contain NaN; the draft head or its features are broken")
    # The policy weighs a round's time against a plain step's: the run's, commit included (as a
    # one-round step's span runs from its draft to its extend, acceptance and commit included), per round.
    elapsed = time.perf_counter() - started
    for _ in range(rounds):
        engine.policy.observe_step(elapsed / rounds, speculative=True)
    # "queue": inside "verify", the host's queuing of the rounds (the rest of "verify" waits for the GPU)
    engine.last_step = StepInfo(0, len(reqs), dict(timer.spans, queue=result.queued_ns))
    return outputs
