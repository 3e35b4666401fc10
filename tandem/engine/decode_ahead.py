"""Several plain decode steps per engine step, queued back to back on the device.

A batch-1 decode step of an 8B model is milliseconds of GPU work and a fraction of a millisecond of host
work (scheduling, staging, sampling, reading the token back). Done one step at a time the two run in
series: the GPU waits while the host handles the token it has just read. Here the host queues step k+1
right after step k — its input token is step k's sampled token, left on the device: with CUDA graphs the
static inputs advance on the device (``TargetGraphRunner.advance``: token, position, KV length, slot),
eagerly it is fed through ``SequenceChunk.device_ids`` — and reads all the tokens back once, after the
last step. The host's work now overlaps the GPU's. (Speculative rounds are queued the same way:
tandem.speculative.chain_rounds.)

What this changes for a request: pages for all the steps are reserved up front, and a request that
stops early (EOS, a stop token, its token budget) has its later tokens computed and dropped (its KV beyond
the stop is released at commit, as after a speculative round). Streaming delivers the steps' tokens together.
Greedy tokens are those of one-step decoding; a sampled request's token draws the uniform of its place in
the sequence (tandem.sampling.token_uniform), as one-step decoding does, so seeded output is the same too.

The engine uses it only when nothing else needs the host between steps (``decode_steps_ahead``:
no prompt waiting, no request speculating, no traffic capture; several ranks with graphs only: the
other ranks follow rank 0's runs, tandem.engine.executor). Log-probabilities are recorded
on the device at each step for the requests that ask, and come back with the tokens; penalties and
min_tokens are applied on the device from token counts the run keeps (tandem.engine.run_rules). With a
drafter, each step's EAGLE-3 features go into the run's own buffer and reach the drafter's requests after
the read-back, held for their next draft (DraftLink.keep_in_step): plain steps run the target-only path
either way.

With CUDA graphs, runs overlap (``engine.overlap_runs``, as runs of speculative rounds do): the step
that reads a run back first queues the next run after it, going on from the device's inputs, so the
GPU does not wait while the host reads back, commits and returns; the next step reads that one back.
A step that finds the batch changed (a prompt waiting, a request finished) queues no run more — a prompt due has
its forward queued behind the run instead (tandem.engine.prompts_behind); a request that stopped has the rest of the
run in flight computed and dropped.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from tandem.forward_batch import ForwardBatch, SequenceChunk
from tandem.engine.prompts_behind import launch_prompts_behind
from tandem.engine.request import Request
from tandem.engine.request_sampling import RunLogprobs
from tandem.engine.run_rules import RunRules
from tandem.staging import HostReadback
from tandem.engine.step import StepInfo, StepOutput, StepTimer
from tandem.sampling import StepSampler


@dataclass
class DecodeRun:
    """Decode steps queued with CUDA graphs and not read back yet, and where a run after them goes on from."""

    reqs: list[Request]
    steps: int
    tokens: HostReadback  # int64 [steps, n], on its way to the host once the steps are done
    features: torch.Tensor | None  # [steps, n, 3H] on the device, each step's input rows (with a drafter)
    logprobs: RunLogprobs | None  # the steps' log-probabilities, for the requests that ask
    rules: RunRules | None  # the token counts of requests with penalties or min_tokens, on the device
    graph_state: tuple  # (verify family, bucket, the last step's tokens [n]): TargetGraphRunner.run_decode_steps


def _sampled_into(runner, reqs: list[Request], steps: int, capture: bool, after: DecodeRun | None = None):
    """→ (the run's token buffer [steps, n] on the device, its feature buffer [steps, n, 3H] or None
    (``capture``: allocated at the first step's features), its RunLogprobs or None, its RunRules or None,
    ``pick(logits, features, k)`` that samples step k into the first — after the rules — copies its
    features into the second and records its log-probabilities, and its StepSampler). ``after``: the run not
    read back that this one follows."""
    # Settings and uniforms reach the device before the first forward is queued.
    queued = 0 if after is None else after.steps  # (the run before, not committed yet: its tokens come first)
    sampler = StepSampler([req.params for req in reqs], [(req.seed, req.num_tokens + queued) for req in reqs], runner.device,
                          runner.model_cfg.vocab_size, steps)
    tokens = torch.empty(steps, len(reqs), dtype=torch.int64, device=runner.device)
    kept: list[torch.Tensor] = []
    logprobs = RunLogprobs.of(reqs, steps, runner.device)
    cfg = runner.model_cfg
    rules = RunRules.of(reqs, steps, runner.device, cfg.vocab_size, cfg.eos_token_ids,
                        None if after is None else after.rules or False, 0 if after is None else after.steps)

    def pick(logits: torch.Tensor, features: torch.Tensor | None, k: int) -> torch.Tensor:
        if capture:
            if not kept:
                kept.append(torch.empty(steps, *features.shape, dtype=features.dtype, device=features.device))
            kept[0][k].copy_(features)
        tokens[k] = sampler(logits if rules is None else rules.apply(logits, k), k)
        if rules is not None:
            rules.update(tokens[k])
        if logprobs is not None:
            logprobs.record(logits, tokens[k], k)
        return tokens[k]

    return tokens, kept, logprobs, rules, pick, sampler


@torch.inference_mode()
def queue_decode_steps(executor, reqs: list[Request], steps: int, after: DecodeRun | None = None,
                       capture: bool = False, restage: bool = True) -> DecodeRun | None:
    """Queue ``steps`` graphed decode steps of ``reqs`` without waiting, on every rank — from their committed
    tokens, or going on after the run ``after`` (the same requests, not read back yet); pages must cover
    every step queued past the committed tokens. ``capture``: keep each step's features. ``restage``: going
    on, the requests' block tables are staged again (False: no page was reserved since ``after`` was queued, so
    the static tables still hold them). None when no graph fits the batch."""
    runner = executor.runner
    if after is None:
        first, tables = ForwardBatch([SequenceChunk([req.tokens[-1]], req.num_tokens - 1, req.kv.page_table())
                                      for req in reqs], capture_features=capture), None
        if runner.graphs is None or not runner.graphs.can_run(first):
            return None
    else:
        first, tables = None, [req.kv.page_table(copy=False) for req in reqs] if restage else None
    tokens, features, logprobs, rules, pick, sampler = _sampled_into(runner, reqs, steps, capture, after)
    alone = logprobs is None and rules is None  # (pick: the sampler alone, and the features' copy)
    state = executor.decode_steps(first, steps, pick, after=after.graph_state if after is not None else None,
                                  tables=tables, features=capture,
                                  whole_run=(tokens, features if capture else None, sampler) if alone else None)
    run = DecodeRun(reqs, steps, HostReadback(tokens), features[0] if capture else None, logprobs, rules, state)
    if logprobs is not None:
        logprobs.queue_readback()
    return run


def read_decode_steps(runner, run: DecodeRun) -> list[list[int]]:
    """Wait for ``run`` → each request's tokens."""
    return _tokens_back(runner, run.tokens)


def _tokens_back(runner, tokens: HostReadback) -> list[list[int]]:
    """Wait for the steps that write ``tokens`` ([steps, n], inside the watchdog when there are graphs)
    → each request's tokens."""
    steps, n = tokens.shape
    waiting = runner.graphs.guard(f"decode ahead: {steps} steps, batch {n}") if runner.graphs else contextlib.nullcontext()
    with waiting:
        per_step = tokens.tolist()
    return [[per_step[k][i] for k in range(steps)] for i in range(n)]


@torch.inference_mode()
def decode_steps_eagerly(executor, reqs: list[Request], steps: int,
                         capture: bool = False) -> tuple[list[list[int]], torch.Tensor | None, dict | None]:
    """Run ``steps`` decode steps of ``reqs`` (pages reserved for all of them) without graphs, or where
    no graph fits the batch → (each request's tokens, the steps' features [steps, n, 3H] when
    ``capture``, the log-probabilities of the requests that ask). Several ranks each read a step's token
    back first (tandem.engine.executor)."""
    runner = executor.runner
    tokens, features, logprobs, _, pick, _ = _sampled_into(runner, reqs, steps, capture)
    _forward_steps(executor, reqs, steps, pick, capture)
    per_request = _tokens_back(runner, HostReadback(tokens))
    if logprobs is not None:
        logprobs.queue_readback()
    return per_request, (features[0] if capture else None), (logprobs.read_steps() if logprobs is not None else None)


def _forward_steps(executor, reqs: list[Request], steps: int, pick, capture: bool) -> None:
    """The same steps through ``executor.forward`` (eager, or a batch no graph fits), each fed the
    previous step's token through ``SequenceChunk.device_ids``."""
    token = None
    for k in range(steps):
        chunks = []
        for i, req in enumerate(reqs):
            committed = req.num_tokens - 1 + k  # KV entries before this step's input token
            if k == 0:
                chunks.append(SequenceChunk([req.tokens[-1]], committed, req.kv.page_table()))
            else:
                chunks.append(SequenceChunk([-1], committed, req.kv.page_table(), device_ids=token[i : i + 1]))
        logits, features = executor.forward(ForwardBatch(chunks, capture_features=capture), sync=False)
        token = pick(logits, features, k)


# -- the engine's side ----------------------------------------------------------------------------
def decode_steps_ahead(engine, reqs: list[Request] | None = None, queued: int = 0) -> int:
    """Plain decode steps of ``reqs`` (default: the running requests) to queue back to back now, past
    ``queued`` steps not read back yet: up to ``engine.decode_steps`` when nothing needs the host
    between them, else 1 (0 when ``queued``: none to queue) — also right after a step of prompts alone (with nothing
    queued), so that the requests it stalled get their next token one step later, not a run later, unless their runs
    are one graph of sub-millisecond steps (``_owes_one_step``)."""
    none = 0 if queued else 1
    steps, reqs = engine.decode_steps, engine.scheduler.running if reqs is None else reqs
    # (several ranks: only with graphs, whose runs every rank follows on the device)
    several_ranks_eager = engine.cfg.tp_size > 1 and engine.executor.runner.graphs is None
    # (after prompts alone the one step is owed first; a run queued behind it is not: one_step_run)
    if (steps <= 1 or not reqs or several_ranks_eager or engine.prompts_due()
            or (engine.accounting.after_prompts and not queued and _owes_one_step(engine, reqs))
            or engine.traffic is not None):
        return none
    context = engine.context_len
    for req in reqs:
        if engine.tree_width(req) != 1 or (engine.processed_logprobs and req.params.logprobs is not None):
            return none  # (runs record raw logprobs only)
        steps = min(steps, context - req.num_tokens - queued)  # never past the context
    # Past the budget of the request with the most tokens to go, no step is of use. A request that reaches its own
    # budget within the run has the rest of it computed and dropped, as after a stop token: under traffic whose
    # answers differ in length one of many requests is nearly always a step or two from its end, and cutting every
    # run to it would make most steps single ones.
    steps = min(steps, max(req.params.max_new_tokens - len(req.output) - queued for req in reqs))
    if steps <= (0 if queued else 1):
        return none
    # Reserving the extra steps' pages must not preempt anyone that one-step decoding would keep.
    if sum(req.kv.pages_needed(req.num_tokens - 1 + queued + steps) for req in reqs) > engine.allocator.num_free:
        return none
    return steps


def _owes_one_step(engine, reqs: list[Request]) -> bool:
    """After prompts alone, whether the requests they stalled take one step before runs resume: not where their runs
    are captured as one graph, at buckets whose plain step takes the device RUN_GRAPH_MAX_STEP_S or less: there a
    run's extra steps add at most that each to the streams' gap (whose tokens come a run at a time anyway), and the
    one step's host cycle (staging, read-back, commit) cost the batch more — at concurrency 8 the demo target spent
    a fifth of its time in such steps (bench/profile_arrivals.py)."""
    graphs = engine.executor.runner.graphs
    return graphs is None or not graphs.run_graphs.whole_at(len(reqs))


def one_step_run(engine) -> bool:
    """Right after a step of prompts alone, whether the running requests' one step (decode_steps_ahead) goes as a run of
    one queued on the device, so that the run after it is queued behind it before it is read back: done on the host,
    that step's sampling, read-back and commit, and the next run's staging, left the device idle (an arrival's two
    steps were a third of a closed loop's time at concurrency 8 with the demo target: bench/profile_arrivals.py)."""
    return (engine.accounting.after_prompts and engine.overlap_runs and engine.executor.runner.graphs is not None
            and decode_steps_ahead(engine, queued=1) > 0)


def step_decode_ahead(engine, reqs: list[Request], steps: int, timer: StepTimer) -> list[StepOutput]:
    """Queue ``steps`` decode steps from the committed tokens, then read them back (overlapped with
    CUDA graphs: see ``_read_back``)."""
    capture = engine.drafts.keeping()
    with timer("verify"):
        run = queue_decode_steps(engine.executor, reqs, steps, capture=capture)
        if run is None:  # eager, or no graph fits: one synchronous run
            tokens, features, logprobs = decode_steps_eagerly(engine.executor, reqs, steps, capture)
    if run is not None:
        return _read_back(engine, run, timer, queued_ahead=False)
    with timer("accept"):
        engine.hold_finished_drafts()  # the drafter gets the steps of requests they end too
        try:
            outputs = engine.commit(reqs, {req.rid: toks for req, toks in zip(reqs, tokens)}, {}, logprobs=logprobs)
            caught_up = _keep_drafter_in_step(engine, reqs, tokens, features)
        finally:
            engine.release_finished_drafts()
    engine.last_step = StepInfo(0, len(reqs), dict(timer.spans), steps=steps, timed=not caught_up)
    return outputs


def step_decode_in_flight(engine, timer: StepTimer) -> list[StepOutput]:
    """A step that starts with decode steps queued and not read back: read them back (queuing more first)."""
    run, engine.run_in_flight = engine.run_in_flight, None
    return _read_back(engine, run, timer, queued_ahead=True)


def _read_back(engine, run: DecodeRun, timer: StepTimer, queued_ahead: bool) -> list[StepOutput]:
    runner = engine.executor.runner
    following = None
    with timer("verify"):
        same_batch = engine.scheduler.running_exactly(run.reqs)
        # (requests due to join the drafter join between runs: a run queued after this one would have no features)
        going_on = engine.overlap_runs and same_batch and not engine.drafts.joins_due
        more = decode_steps_ahead(engine, run.reqs, queued=run.steps) if going_on else 0
        if more:
            pages = sum(len(req.kv.pages) for req in run.reqs)
            for req in run.reqs:
                req.kv.reserve(req.num_tokens - 1 + run.steps + more)
            capture = run.features is not None and engine.drafts.keeping()  # (not once the drafter is detached)
            # (nothing else stages this batch's tables while its run is in flight: only new pages need staging)
            following = queue_decode_steps(engine.executor, run.reqs, more, after=run, capture=capture,
                                           restage=sum(len(req.kv.pages) for req in run.reqs) != pages)
        # nothing queued behind the run because prompts are due: their forward goes behind it (prompts_behind)
        prompts = launch_prompts_behind(engine, run.steps, timer) if following is None and queued_ahead else None
        tokens = read_decode_steps(runner, run)
        prompts_from = time.perf_counter() if prompts is not None else None  # (the device goes on to the prompts)
        logprobs = run.logprobs.read_steps() if run.logprobs is not None else None
    with timer("accept"):
        live = [(req, toks) for req, toks in zip(run.reqs, tokens) if not req.finished]  # not aborted since
        engine.hold_finished_drafts()
        try:
            outputs = engine.commit([req for req, _ in live], {req.rid: toks for req, toks in live}, {},
                                    keep_pages=following is not None, logprobs=logprobs)
            caught_up = _keep_drafter_in_step(engine, run.reqs, tokens, run.features)
        finally:
            engine.release_finished_drafts()
    if following is not None and all(req.finished for req in following.reqs):
        read_decode_steps(runner, following)  # no one left to commit it to
        following = None
    engine.run_in_flight = following
    engine.last_step = StepInfo(0, len(live), dict(timer.spans), steps=run.steps, timed=not caught_up,
                                queued_ahead=queued_ahead)
    if prompts is not None:  # (the step then reports as prompts alone: decoding is owed after it)
        outputs += engine.verify_read(prompts, timer, timed_from=prompts_from)
    return outputs


def _keep_drafter_in_step(engine, reqs: list[Request], tokens: list[list[int]], features: torch.Tensor | None) -> bool:
    """Hand the steps' tokens and features ([steps, n, 3H]) of the requests that go on drafting to the
    drafter (held for their next draft; with the prefix cache and the batch speculating, also those that end
    here, sent as their draft state is released); → whether a request's held features had to be sent now."""
    if features is None:
        return False
    last_turn = engine.drafts.completes(finishing=True)  # held for the extend their release sends
    items = [(req, toks, column) for req, toks, column in zip(reqs, tokens, features.unbind(1), strict=True)
             if (last_turn or not req.finished) and req.spec is not None and req.follows_drafter]
    # a run's features are its own copy, no graph's buffer: held as they are where every request holds its column (a
    # held view keeps the whole run alive, which the held bytes count only then)
    return engine.drafts.keep_in_step(items, owned=len(items) == len(reqs))
