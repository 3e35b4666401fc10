"""What one engine step reports: tokens per request, and the step's shape and phase timings."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

from tandem.engine.request import FinishReason


@dataclass
class StepOutput:
    rid: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    drafted: int = 0  # draft tokens verified for this request this round
    accepted: int = 0  # of which accepted (the bonus token not counted)


@dataclass
class StepInfo:
    num_prefill: int
    num_decode: int
    seconds: dict[str, float]  # phase -> wall time: draft, verify, accept, draft_extend


class StepTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = time.perf_counter() - started
