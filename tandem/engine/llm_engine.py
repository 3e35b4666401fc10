"""LLMEngine: target-only generation in process — requests in, tokens out, continuous batching.

This is the API the services wrap: ``add_request`` queues a prompt, ``step`` runs one forward over
everything schedulable and returns the tokens it produced, ``generate`` loops to completion.
"""

from __future__ import annotations

import itertools
import logging
import zlib
from dataclasses import dataclass

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.executor import TargetExecutor
from tandem.engine.request import FinishReason, GenerationResult, Request
from tandem.engine.scheduler import Scheduler
from tandem.errors import ConfigError
from tandem.kv_cache import PageAllocator, SequenceKV
from tandem.sampling import SamplingParams, make_generator, sample

log = logging.getLogger("tandem.engine")


@dataclass
class StepOutput:
    rid: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.executor = TargetExecutor(cfg)
        self.model_config = self.executor.model_config
        self.allocator = PageAllocator(self.executor.num_pages, cfg.page_size, cfg.page_shuffle_seed)
        self.scheduler = Scheduler(self.allocator, cfg.max_running_requests, cfg.max_prefill_tokens)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self.executor.shutdown()

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams, rid: str | None = None) -> str:
        params.validate()
        context = self.model_config.max_position_embeddings
        vocab = self.model_config.vocab_size
        if not prompt:
            raise ConfigError("prompt is empty")
        if len(prompt) >= context:
            raise ConfigError(f"prompt has {len(prompt)} tokens; the model's context is {context}")
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ConfigError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        rid = rid if rid is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ConfigError(f"request id '{rid}' is already in use")
        # A stable per-request seed (Python's str hash is salted per process).
        seed = params.seed if params.seed is not None else (self.cfg.seed * 1_000_003 + zlib.crc32(rid.encode())) & 0x7FFFFFFF
        req = Request(rid, list(prompt), params, make_generator(seed), SequenceKV(self.allocator))
        self.scheduler.add(req)
        self.requests[rid] = req
        return rid

    def abort(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is not None and not req.finished:
            req.finish_reason = FinishReason.ABORT
            self.scheduler.finish(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        step = self.scheduler.schedule()
        if step is None:
            if self.scheduler.waiting:
                raise RuntimeError("scheduler made no progress with requests waiting (KV cache too small?)")
            return []
        logits, _ = self.executor.forward(step.batch)  # one row per request: its last token
        reqs = step.requests
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs]).tolist()
        outputs = []
        for req, token in zip(reqs, tokens):
            req.output.append(token)
            reason = self._finish_reason(req, token)
            if reason is not None:
                req.finish_reason = reason
                self.scheduler.finish(req)
            outputs.append(StepOutput(req.rid, [token], reason))
        return outputs

    def _finish_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        if not p.ignore_eos and token in self.model_config.eos_token_ids:
            return FinishReason.STOP
        if token in p.stop_token_ids:
            return FinishReason.STOP
        if len(req.output) >= p.max_new_tokens:
            return FinishReason.LENGTH
        if len(req.tokens) >= self.model_config.max_position_embeddings:
            return FinishReason.LENGTH
        return None

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[GenerationResult]:
        """Run the prompts to completion together; results in prompt order."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt)]
        while any(not self.requests[r].finished for r in rids):
            self.step()
        results = []
        for rid in rids:
            req = self.requests.pop(rid)
            results.append(GenerationResult(rid, req.prompt, req.output, req.finish_reason.value))
        return results

    @torch.inference_mode()
    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        """Logits at every prompt position ([len, V]); a diagnostic the tests compare with references."""
        from tandem.engine.batch import ForwardBatch, SequenceChunk

        kv = SequenceKV(self.allocator)
        kv.reserve(len(prompt))
        try:
            logits, _ = self.executor.forward(ForwardBatch([SequenceChunk(prompt, 0, list(kv.pages), logits="all")]))
        finally:
            kv.release()
        return logits
