"""A generation request and its lifecycle state on rank 0."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tandem.kv_cache import SequenceKV
from tandem.sampling import SamplingParams
from tandem.speculative.policy import RequestSpecState
from tandem.speculative.stats import SpecStats


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-sequence or stop token
    LENGTH = "length"  # max_new_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller


def tokens_until_finish(tokens: list[int], req: "Request", eos_token_ids, context_len: int,
                        capacity_tokens: int) -> tuple[list[int], FinishReason | None]:
    """``tokens`` emitted for ``req`` up to the first that finishes it, and why — as if each were appended and
    checked in turn, a stop before a length: an end-of-sequence (unless ignore_eos) or stop token; its
    max_new_tokens, the context, or past ``capacity_tokens`` (its next step would not fit in the whole KV cache).
    One set test a run instead of five checks a token (commit was a fifth of an engine's host time at batch 8 in
    process: cProfile, bench/detached_plain.py --profile)."""
    p, before = req.params, req.num_tokens
    # k tokens appended reach a length's end once k >= room (the k-th, index room - 1; at least the first)
    room = min(p.max_new_tokens - len(req.output), context_len - before, capacity_tokens + 1 - before)
    last = min(max(room, 1), len(tokens))  # tokens the length leaves
    stops = set(p.stop_token_ids)
    if not p.ignore_eos:
        stops.update(eos_token_ids)
    if stops and not stops.isdisjoint(tokens[:last]):
        return tokens[: next(i for i, t in enumerate(tokens) if t in stops) + 1], FinishReason.STOP
    return tokens[:last], (FinishReason.LENGTH if tokens and room <= len(tokens) else None)


@dataclass(eq=False)  # one object per request: compared by identity (the scheduler's `in` tests run per step)
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    seed: int  # its sampling's: token i draws tandem.sampling.token_uniform(seed, i)
    kv: SequenceKV
    output: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    spec: Any = None  # SpecConfig of this request, or None when it does not speculate
    draft_ready: bool = False  # the proposer holds this request's draft state (it can draft now)
    # The drafter's start on the request's first tokens, made right before its first extend (None once made, or never
    # due): with the prefix cache, on the prompt's cached tokens while the batch decodes plainly (DraftLink.attach);
    # or on all it had committed when a drafter attached again found it running (DraftLink.join_running).
    attach_at: int | None = None
    spec_stats: SpecStats = field(default_factory=SpecStats)
    spec_state: RequestSpecState = field(default_factory=RequestSpecState)  # the policy's view of it
    # Plain steps' (tokens, features) not yet given to the drafter — and the prompt's, for a request
    # that starts with speculation off: they go in one extend right before the request's next draft,
    # so decoding with speculation off costs no drafter work per step (see DraftLink.hold).
    pending_extend: list = field(default_factory=list)
    pending_bytes: int = 0  # size of the features held in pending_extend
    # params.prompt_logprobs: the prompt's entries gathered chunk by chunk, sent with the first token
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    # Prefix caching (tandem.prefix_cache): chained keys of the full blocks of ``tokens`` computed so far,
    # the tokens found cached at the current admission (prefilled from there), and at the first (what
    # usage reports; None until the request is first admitted).
    block_keys: list = field(default_factory=list)
    cache_salt: str = ""  # only requests of the same salt share cached pages ("" : the unsalted ones)
    prefix_hit: int = 0
    cached_tokens: int | None = None

    @property
    def tokens(self) -> list[int]:
        """Prompt and output as one new list (O(length): hot paths use num_tokens / last_token)."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def follows_drafter(self) -> bool:
        """Whether its steps' features go to the drafter: it holds draft state, or starts on it at its next extend."""
        return self.draft_ready or self.attach_at is not None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationResult:
    rid: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    spec_stats: SpecStats = field(default_factory=SpecStats)
