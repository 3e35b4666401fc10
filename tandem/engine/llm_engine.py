"""LLMEngine: generation in process — requests in, tokens out, continuous batching, optional EAGLE-3.

This is the API the services wrap: ``add_request`` queues a prompt, ``step`` runs one round over
everything schedulable and returns the tokens it produced, ``generate`` loops to completion.

Plain decoding and speculative decoding are one loop. Every running request verifies a draft tree
rooted at its last token; without a proposer (or with speculation off for that request) the tree is
just the root, and verifying it *is* a decode step. New prompts are prefilled in the same forward.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import zlib
from typing import TYPE_CHECKING

import torch

from tandem.engine.acceptance import accept_verified
from tandem.engine.batch_decision import BatchDecision
from tandem.forward_batch import ForwardBatch, SequenceChunk
from tandem.engine.config import DEFAULT_SPEC_ROUNDS, EngineConfig
from tandem.engine.decode_ahead import (DecodeRun, decode_steps_ahead, one_step_run, step_decode_ahead,
                                         step_decode_in_flight)
from tandem.engine.draft_link import DraftLink
from tandem.engine.executor import TargetExecutor
from tandem.engine.request import FinishReason, GenerationResult, Request, tokens_until_finish
from tandem.engine.request_sampling import prompt_logits_skip
from tandem.engine.rounds_ahead import rounds_ahead, step_rounds_ahead, step_run_in_flight
from tandem.engine.scheduler import Schedule, Scheduler
from tandem.engine.step_accounting import StepAccounting
from tandem.engine.step_chain import StepChain
from tandem.engine.step import LaunchedVerify, StepInfo, StepOutput, StepTimer
from tandem.errors import ConfigError, DuplicateRequestError
from tandem.kv_cache import PageAllocator, SequenceKV
from tandem.logprobs import TokenLogprobs
from tandem.prefix_cache import PrefixCache
from tandem.sampling import SamplingParams
from tandem.speculative.attachment import DrafterAttachment
from tandem.speculative.policy import SpeculationPolicy
from tandem.speculative.tree import DraftTree
from tandem.speculative.proposer import Proposer
from tandem.engine.verify import verify_chunk

if TYPE_CHECKING:
    from tandem.speculative.spec_config import SpecConfig

log = logging.getLogger("tandem.engine")
DEFAULT = "default"


class LLMEngine:
    def __init__(self, cfg: EngineConfig, proposer: Proposer | None = None, spec: "SpecConfig | None" = None,
                 policy: SpeculationPolicy | None = None):
        """``proposer`` drafts trees (an in-process drafter, or a client of the drafter service); ``spec``
        is the default speculation setting of requests (None: off); ``policy`` turns speculation off for
        requests where it does not pay (default: measured; ``SpeculationPolicy(PolicyConfig(enabled=False))``
        always speculates)."""
        self.cfg = cfg
        self.policy = policy or SpeculationPolicy()
        self.proposer = proposer
        self.default_spec = spec if proposer is not None else None
        self.executor = TargetExecutor(cfg)
        self.model_config = self.executor.model_config
        self.context_len = cfg.served_context(self.model_config.max_position_embeddings)  # --context-length
        self.prefix_cache = PrefixCache(cfg.page_size) if cfg.enable_prefix_caching else None
        self.allocator = PageAllocator(self.executor.num_pages, cfg.page_size, cfg.page_shuffle_seed,
                                       cache=self.prefix_cache)
        self.scheduler = Scheduler(self.allocator, cfg.max_running_requests, cfg.chunked_prefill_size)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.last_step: StepInfo | None = None
        self.traffic = None  # a TrafficRecorder (tandem.traffic) when served traffic is captured for training
        self.phase_sync = None  # profiling: called at each phase end (see StepTimer)
        self.drafts = DraftLink(self)  # the drafter's per-request state, kept in step with the target
        self.chain = StepChain()  # the chain default requests draft now (the policy may shorten it at batch)
        self.speculating = True  # the policy's latest decision for the batch (a first batch finds out)
        self.plain_reason: str | None = None  # why it was plain, in a word (the verifier's stats line tallies them)
        self._steps_after_switch = 0  # steps still to run after the chain's depth changed (not timed)
        self.undrafted = False  # the latest decision's batch held requests that could not draft (no drafter state)
        self.decide = BatchDecision()  # the running batch's speculation decision, once a step
        self.attachment = DrafterAttachment()  # a batch kept plain detaches the drafter (see its module)
        graphed = self.executor.runner.graphs is not None
        self.decode_steps = cfg.decode_steps_with(graphed)
        self.spec_rounds = cfg.spec_rounds or (DEFAULT_SPEC_ROUNDS if graphed else 1)
        self.overlap_runs = cfg.overlap_runs  # queue a run of steps or rounds before reading the last one back
        self.processed_logprobs = cfg.logprobs_mode == "processed_logprobs"
        self.prefill_apart = graphed if cfg.mixed_prefill is None else not cfg.mixed_prefill
        # decoding owed after prompts alone; each step's time and goodput to the policy
        self.accounting = StepAccounting(self.prefill_apart)
        # a run of decode steps or of rounds queued and not read back (tandem.engine.decode_ahead, .rounds_ahead)
        self.run_in_flight = None
        self._finishing: list[Request] | None = None  # finished, draft state kept (hold_finished_drafts)

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self, release: bool = True) -> None:
        """Stop the target's ranks; ``release``: give the device memory back too (the drafter's graphs first:
        they live in the target's graph pool). Not while another thread may still be in a step."""
        self.run_in_flight = None  # its device work is abandoned with the executor
        if release and self.proposer is not None:
            self.proposer.release_device()
        self.executor.shutdown(release)

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams, rid: str | None = None,
                    spec: "SpecConfig | None | str" = DEFAULT, cache_salt: str = "") -> str:
        """Queue a prompt. ``spec``: the request's speculation setting (default: the engine's; None: off);
        ``cache_salt``: it shares cached prefix pages only with requests of the same salt (tandem.prefix_cache)."""
        params.validate()
        context, vocab = self.context_len, self.model_config.vocab_size
        if not prompt:
            raise ConfigError("prompt is empty")
        if len(prompt) >= context:
            raise ConfigError(f"prompt has {len(prompt)} tokens; the served context is {context}")
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ConfigError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ConfigError(f"stop_token_ids: {bad} is outside the vocabulary [0, {vocab})")
        rid = rid if rid is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise DuplicateRequestError(f"request id '{rid}' is already in use")
        if spec == DEFAULT:
            spec = self.chain.for_new_request(self.default_spec)
        elif spec is not None and self.proposer is None:
            raise ConfigError("speculation was requested but the engine has no draft model")
        # A stable per-request seed (Python's str hash is salted per process).
        seed = params.seed if params.seed is not None else (self.cfg.seed * 1_000_003 + zlib.crc32(rid.encode())) & 0x7FFFFFFF
        req = Request(rid, list(prompt), params, seed, SequenceKV(self.allocator), spec=spec, cache_salt=cache_salt)
        self.scheduler.add(req)
        self.requests[rid] = req
        return rid

    def abort(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is not None and not req.finished:
            req.finish_reason = FinishReason.ABORT
            self._finish(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- one round -------------------------------------------------------------------------------
    def _fits(self, req: Request, width: int) -> bool:
        """Whether a verify of ``width`` rows stays inside the context and the whole KV cache (near either
        end a request decodes plainly, which always fits until it finishes)."""
        return (req.num_tokens + width <= self.context_len
                and self.allocator.pages_for(req.num_tokens - 1 + width) <= self.allocator.capacity_pages)

    def can_draft(self, req: Request) -> bool:
        """Whether the request could speculate this step: a drafter state, and room for its tree."""
        return req.spec is not None and req.draft_ready and self._fits(req, req.spec.num_draft_tokens)

    def tree_width(self, req: Request) -> int:
        """Tokens the request's draft tree holds this round, or 1 when it does not draft."""
        return req.spec.num_draft_tokens if self.speculating and self.can_draft(req) else 1

    def prompts_due(self) -> bool:
        """Whether a waiting prompt is prefilled now (and runs queued ahead stay short meanwhile): one can be
        admitted and, with prompts apart, the running requests have decoded as long as the last step of prompts
        alone took."""
        return self.scheduler.can_admit() and not (self.prefill_apart and self.accounting.decode_owed_s > 0)

    def _row_width(self, req: Request, width: int) -> int:
        """The request's rows in a verify of ``width``: its tree, or filler up to ``width`` where it fits."""
        return width if self._fits(req, width) else 1

    def step(self) -> list[StepOutput]:
        """One round: draft (for speculating requests), one target forward over prefills and trees,
        acceptance, KV compaction, and the drafter's extension with the new tokens' features. Its wall
        time goes to the policy, by batch size and kind."""
        started, self.last_step = time.perf_counter(), None
        self.accounting.step_starts(started, self.policy)
        running, switches = len(self.scheduler.running), self.chain.switches
        outputs = self._step()
        if self.chain.switches != switches:  # (see StepAccounting.step_ended's ``switched``)
            self._steps_after_switch = 2
        if self.last_step is not None:
            if running and self.last_step.num_prefill and not self.last_step.num_decode and not outputs:
                # A prompt's chunk emits no token, so nothing waited for its device work: its time (the prefill
                # pace's measure of what a chunk stalls the streams) would be only its launch's.
                self.executor.synchronize()
            self.accounting.step_ended(self.policy, self.last_step, started, time.perf_counter(), running,
                                       len(self.scheduler.running), self.speculating, self.proposer, self.drafts.up(),
                                       sum(len(o.new_token_ids) for o in outputs), self.attachment.detached,
                                       switched=self._steps_after_switch > 0, undrafted=self.undrafted)
        self._steps_after_switch = max(0, self._steps_after_switch - 1)
        return outputs

    def _step(self) -> list[StepOutput]:
        """Schedule the step and run it: a queued run read back, a run of decode steps or rounds queued
        ahead, or one verify forward."""
        timer = StepTimer(self.phase_sync)
        self.drafts.after_reconnect()
        if self.run_in_flight is None and (joined := self.drafts.join_running()):
            log.info("%d running request(s) without draft state join the drafter (their entries rebuilt)", joined)
        width = self.decide(self)  # decided once per step, before any page is reserved
        if isinstance(self.run_in_flight, DecodeRun):  # read it back first (queuing the next run where
            return step_decode_in_flight(self, timer)  # nothing changed)
        if self.run_in_flight is not None:
            return step_run_in_flight(self, timer)
        # Prompts apart: a step of prompts alone, then one of the running requests (graphed, or a queued run).
        apart = self.prefill_apart and bool(self.scheduler.running)
        # while requests decode, a long prompt's chunks are cut to their pace (tandem.engine.prefill_pace)
        cap = None
        if self.scheduler.waiting and self.scheduler.running:  # (asked only then: not on every round)
            cap = self.accounting.pace.chunk_cap(self.spec_rounds if self.speculating else self.decode_steps,
                                                 self.speculating, self.executor.prefill_graph_width)
        sched = None
        if apart and self.prompts_due():
            sched = self.scheduler.schedule(lambda req: self._row_width(req, width), decode=False, chunk_cap=cap)
            sched = sched if sched.prefill else None  # nothing fit beside the running requests' next step
        ahead = decode_steps_ahead(self) if width == 1 and sched is None else 1
        rounds = rounds_ahead(self) if width > 1 and sched is None else 0
        if sched is None:
            widths = ((lambda req: ahead) if ahead > 1 else (lambda req: rounds * req.spec.num_draft_tokens) if rounds
                      else (lambda req: self._row_width(req, width)))
            sched = self.scheduler.schedule(widths, admit=not apart, chunk_cap=cap)
        for req in sched.preempted:
            self.drafts.forget(req)
        if not sched:
            if self.scheduler.waiting:
                raise RuntimeError("scheduler made no progress with requests waiting (KV cache too small?)")
            return []
        if (ahead > 1 or (width == 1 and one_step_run(self))) and not sched.prefill and not sched.preempted:
            return step_decode_ahead(self, sched.decode, ahead, timer)
        if rounds and not sched.prefill and not sched.preempted:
            return step_rounds_ahead(self, sched.decode, rounds, timer)
        return self._verify_step(sched, width, timer)

    def _verify_step(self, sched: Schedule, width: int, timer: StepTimer) -> list[StepOutput]:
        """Draft the trees, one target forward over the prompts' chunks and the trees (rows of ``width``),
        acceptance, the commit, and the drafter's extension with the new tokens' features."""
        return self.verify_read(self.verify_launch(sched, width, timer), timer)

    def verify_launch(self, sched: Schedule, width: int, timer: StepTimer, sync: bool = True) -> LaunchedVerify:
        """``_verify_step`` up to its forward, queued (``sync=False``: not waited for; the acceptance's read-back
        waits)."""
        with timer("draft"):
            catch_up = [req for req in sched.decode if req.pending_extend and self.tree_width(req) > 1]
            self.drafts.flush_pending(catch_up)
            trees = self.drafts.draft(sched.decode, self.tree_width)
            for req in sched.decode:  # requests that draw no tree this step: filler of the batch's width
                rows = self._row_width(req, width)
                if trees[req.rid].size == 1 and rows > 1:
                    trees[req.rid] = DraftTree.padded(req.last_token, rows)
        # A prompt's chunk appends to the KV of its chunks before (its prefix); only a last chunk samples.
        skips = [prompt_logits_skip(p) for p in sched.prefill]  # (a prompt scored from a position: its rows from there)
        chunks = [SequenceChunk(p.req.tokens[p.start : p.end], p.start, p.req.kv.page_table(),
                                logits="last" if skip is None else "all", logits_from=skip or 0)
                  for p, skip in zip(sched.prefill, skips)]
        chunks += [verify_chunk(req, trees[req.rid]) for req in sched.decode]
        capture = self.drafts.keeping() or self.traffic is not None
        with timer("verify"):
            logits, features = self.executor.forward(ForwardBatch(chunks, capture_features=capture), sync=sync)
        return LaunchedVerify(sched, width, trees, logits, features if capture else None, bool(catch_up), sync)

    def verify_read(self, launched: LaunchedVerify, timer: StepTimer,
                    timed_from: float | None = None) -> list[StepOutput]:
        """The rest of ``_verify_step`` after ``verify_launch``: acceptance, the commit, the drafter's extension.
        ``timed_from``: the step's own time starts there (StepInfo.timed_from)."""
        sched, width, trees = launched.sched, launched.width, launched.trees
        if not launched.waited:  # (a hung forward stops the engine; a chunk that samples nothing is waited for too)
            graphs = self.executor.runner.graphs
            with graphs.guard("prompts queued behind a run") if graphs is not None else contextlib.nullcontext():
                self.executor.synchronize()
        self.hold_finished_drafts()  # until after the extend below
        try:
            with timer("accept"):
                accepted = accept_verified(
                    sched, trees, launched.logits, launched.features, policy=self.policy, drafts=self.drafts,
                    move_kv=self.executor.move_kv, traffic=self.traffic, eos_token_ids=self.model_config.eos_token_ids,
                    processed_logprobs=self.processed_logprobs, speculating=self.speculating)
                for p in sched.prefill:
                    if not p.last:
                        p.req.kv.commit(p.end)
                outputs = self.commit([p.req for p in sched.prefill if p.last] + sched.decode, accepted.emitted,
                                      accepted.rounds, logprobs=accepted.logprobs)
                for p in sched.prefill:
                    if p.last and not p.req.finished:
                        self.scheduler.cache_committed(p.req)
            with timer("draft_extend"):
                last_turn = self.prefix_cache is not None
                self.drafts.extend([item for item in accepted.extend_items if last_turn or not item[0].finished])
                self.release_finished_drafts()
                self.drafts.prefetch(self.tree_width)  # a service drafter starts on the next step's trees now
        finally:
            self.release_finished_drafts()
        # A catch-up of held plain steps is the price of switching speculation back on, not of a round:
        # such a step's time goes to the policy apart (a resume).
        self.last_step = StepInfo(len(sched.prefill), len(sched.decode), dict(timer.spans),
                                  prefill_tokens=sum(p.end - p.start for p in sched.prefill),
                                  speculative=any(tree.drafted for tree in trees.values()),
                                  timed=not launched.caught_up and not accepted.caught_up, width=width,
                                  timed_from=timed_from)
        return outputs

    def commit(self, reqs: list[Request], emitted: dict[str, list[int]],
               rounds: dict[str, tuple[int, int]], keep_pages: bool = False,
               logprobs: dict[str, list[TokenLogprobs]] | None = None) -> list[StepOutput]:
        """Append each request's new tokens up to its first stop, and retire finished requests.
        ``keep_pages``: the pages reserved past a running request's tokens stay (a run of decode steps or
        rounds queued further writes into them). ``logprobs``: per request, one entry per emitted token."""
        outputs = []
        for req in reqs:
            new, reason = tokens_until_finish(emitted[req.rid], req, self.model_config.eos_token_ids, self.context_len,
                                              self.allocator.capacity_pages * self.allocator.page_size)
            req.output.extend(new)
            if reason is None and keep_pages:
                req.kv.commit(req.num_tokens - 1)
            elif reason is None:
                req.kv.truncate(req.num_tokens - 1)  # committed KV: everything but the newest token
            else:
                req.finish_reason = reason
                req.kv.commit(req.num_tokens - 1)  # every token but the newest has its KV (the cache keeps it)
                self._finish(req)
            drafted, accepted = rounds.get(req.rid, (0, 0))
            stats = req.spec_stats if reason is not None else None
            token_logprobs = logprobs[req.rid][: len(new)] if logprobs and req.rid in logprobs else None
            prompt_logprobs = None
            if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
                prompt_logprobs, req.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs or [], None, True
            outputs.append(StepOutput(req.rid, new, reason, drafted, stats, [accepted] if drafted else [],
                                      token_logprobs, prompt_logprobs, req.cached_tokens or 0))
        return outputs

    def hold_finished_drafts(self) -> None:
        """Until ``release_finished_drafts``, a request that finishes keeps its draft state, so that the
        drafter gets the step's last tokens first (an extend, a run's commit): with the prefix cache, the
        pages it caches are then whole for a next turn."""
        self._finishing = []

    def release_finished_drafts(self) -> None:
        finishing, self._finishing = self._finishing or [], None
        self.drafts.forget_all(finishing, finishing=True)

    def _finish(self, req: Request) -> None:
        if req.output:
            self.policy.observe_finished(len(req.prompt), len(req.output))
        self.scheduler.finish(req)
        if self._finishing is not None:
            self._finishing.append(req)
        else:
            self.drafts.forget(req, finishing=True)
        if self.traffic is not None:
            # A cancelled request keeps what the target wrote before (clients cancel at a stop string).
            if req.finish_reason == FinishReason.ABORT and not req.output:
                self.traffic.discard(req.rid)
            else:
                self.traffic.finished(req.rid, req.prompt, req.output, {
                    "temperature": req.params.temperature, "finish_reason": req.finish_reason.value})

    # -- conveniences ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 spec: "SpecConfig | None | str" = DEFAULT) -> list[GenerationResult]:
        """Run the prompts to completion together; results in prompt order."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.add_request(p, sp, spec=spec) for p, sp in zip(prompts, per_prompt)]
        while any(not self.requests[r].finished for r in rids):
            self.step()
        results = []
        for rid in rids:
            req = self.requests.pop(rid)
            results.append(GenerationResult(rid, req.prompt, req.output, req.finish_reason.value, req.spec_stats))
        return results

    @torch.inference_mode()
    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        """Logits at every prompt position ([len, V]); a diagnostic the tests compare with references."""
        kv = SequenceKV(self.allocator)
        kv.reserve(len(prompt))
        try:
            logits, _ = self.executor.forward(ForwardBatch([SequenceChunk(prompt, 0, kv.page_table(), logits="all")]))
        finally:
            kv.release()
        return logits
