"""Scheduler: which requests run in the next forward, and the KV pages they need.

Every step runs all running requests (decode: their last token, or a draft tree rooted at it)
together with newly admitted prompts (prefill), packed into one forward. A prompt is admitted only
when its pages fit now; when a running request cannot get pages for its next step, the most recently
admitted request is preempted: its pages are freed and it goes back to the front of the queue, to be
recomputed from its tokens later (its output so far is kept, so nothing is lost and greedy output is
unchanged).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tandem.engine.request import Request
from tandem.errors import OutOfPagesError
from tandem.kv_cache import PageAllocator


@dataclass
class Schedule:
    decode: list[Request] = field(default_factory=list)  # running; pages reserved for their step width
    prefill: list[Request] = field(default_factory=list)  # newly admitted; pages reserved for all their tokens
    preempted: list[Request] = field(default_factory=list)  # sent back to the queue this step

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_running: int, max_prefill_tokens: int):
        self.allocator = allocator
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        needed = self.allocator.pages_for(len(request.prompt) + 1)
        if needed > self.allocator.capacity_pages:
            raise OutOfPagesError(
                f"the prompt needs {needed} KV pages and this server's whole KV cache has "
                f"{self.allocator.capacity_pages}: it can never fit; shorten it"
            )
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def running_exactly(self, reqs: list[Request]) -> bool:
        """Whether the running requests are ``reqs``, the same objects in the same order: the batch a run
        queued on the device (tandem.engine.decode_ahead, rounds_ahead) was queued for."""
        return len(self.running) == len(reqs) and all(a is b for a, b in zip(self.running, reqs))

    def schedule(self, step_width: Callable[[Request], int] = lambda r: 1) -> Schedule:
        """Reserve pages for every running request's next step (``step_width`` new tokens after its
        committed ones: 1 for plain decoding, the tree size when it speculates), then admit prompts."""
        out = Schedule()
        for req in list(self.running):
            if req not in self.running:  # preempted while making room for an older request
                continue
            needed_tokens = req.num_tokens - 1 + step_width(req)
            while req.kv.pages_needed(needed_tokens) > self.allocator.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req in self.running:
                req.kv.reserve(needed_tokens)
                out.decode.append(req)
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            n = req.num_tokens
            fits_budget = n <= budget or budget == self.max_prefill_tokens  # one long prompt always may go
            if not fits_budget or req.kv.pages_needed(n) > self.allocator.num_free:
                break
            self.waiting.popleft()
            req.kv.reserve(n)
            budget -= n
            self.running.append(req)
            out.prefill.append(req)
        return out

    def requeue(self, req: Request) -> None:
        """Send a running request back to the front of the queue: its KV is recomputed by a prefill
        (used to rebuild a reconnected drafter's state from the whole sequence)."""
        if req in self.running:
            self._preempt(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.kv.release()
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.kv.release()
