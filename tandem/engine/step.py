"""What one engine step reports: tokens per request, and the step's shape and phase timings."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.request import FinishReason
from tandem.logprobs import TokenLogprobs
from tandem.speculative.stats import SpecStats


@dataclass
class LaunchedVerify:
    """A verify forward queued and not read back (LLMEngine.verify_launch → verify_read)."""
    sched: Any  # the step's Schedule
    width: int
    trees: dict  # rid -> DraftTree
    logits: Any  # torch.Tensor, still being computed
    features: Any  # torch.Tensor | None
    caught_up: bool  # the draft first sent held input to the drafter (not timed)
    waited: bool  # the forward was waited for at launch (else verify_read waits, inside the watchdog)


@dataclass
class StepOutput:
    rid: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    drafted: int = 0  # draft tokens verified for this request this step
    spec_stats: SpecStats | None = None  # the request's totals, on its final output
    # Accepted drafts (the bonus token not counted) of each speculative round this step: one round, or a
    # run of rounds queued on the device (tandem.engine.rounds_ahead); empty for a plain step.
    round_accepts: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # one per new token, for requests that asked (params.logprobs)
    prompt_logprobs: list[TokenLogprobs] | None = None  # on the first output: one per prompt token after the first
    cached_tokens: int = 0  # prompt tokens the request found in the prefix cache (not prefilled)

    @property
    def accepted(self) -> int:
        """Draft tokens accepted this step, over all its rounds."""
        return sum(self.round_accepts)


@dataclass
class StepInfo:
    num_prefill: int
    num_decode: int
    spans: dict[str, tuple[int, int]]  # phase -> (start, end) wall-clock ns: draft, verify, accept, draft_extend
    steps: int = 1  # decode steps or speculative rounds each request went through (runs queued ahead: several)
    speculative: bool = False  # the step drafted (a round), else a plain decode step
    timed: bool = True  # its wall time is that of its steps alone (no catch-up of held drafter input)
    prefill_tokens: int = 0  # prompt tokens prefilled (whole prompts or chunks)
    width: int = 1  # a speculative step's verify width (its chain's drafts + 1, or its tree's size)
    queued_ahead: bool = False  # its run was queued by the step before, behind the run that step read back
    # (perf_counter) where its own time starts, when not at its start: prompts queued behind a run that this step read
    # back first are timed from that read-back (tandem.engine.prompts_behind)
    timed_from: float | None = None

    @property
    def seconds(self) -> dict[str, float]:
        return {phase: (end - start) / 1e9 for phase, (start, end) in self.spans.items()}


class StepTimer:
    def __init__(self, sync=None):
        """``sync``: called at the end of every phase (e.g. torch.cuda.synchronize) so that a phase's span
        includes its device work; a profiling aid — it serialises host and device."""
        self.spans: dict[str, tuple[int, int]] = {}  # phase -> (start, end) in wall-clock ns (for traces)
        self.sync = sync

    @contextmanager
    def __call__(self, phase: str):
        started = time.time_ns()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.spans[phase] = (started, time.time_ns())
