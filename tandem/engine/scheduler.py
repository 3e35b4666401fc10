"""Scheduler: which requests run in the next forward, and the KV pages they need.

Every step runs all running requests' next token (decode) together with newly admitted prompts
(prefill), packed into one forward. A prompt is admitted only when its pages fit now; when a running
request cannot get a page for its next token, the most recently admitted request is preempted: its
pages are freed and it goes back to the front of the queue, to be recomputed from its tokens later
(its output so far is kept, so nothing is lost and greedy output is unchanged).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tandem.engine.batch import ForwardBatch, SequenceChunk
from tandem.engine.request import Request
from tandem.errors import OutOfPagesError
from tandem.kv_cache import PageAllocator


@dataclass
class ScheduledStep:
    batch: ForwardBatch
    requests: list[Request]  # in batch order


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
                f"request {request.rid} needs {needed} KV pages for its prompt, the whole cache has "
                f"{self.allocator.capacity_pages}; give the cache more memory"
            )
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, capture_features: bool = False) -> ScheduledStep | None:
        chunks: list[SequenceChunk] = []
        scheduled: list[Request] = []
        for req in self._reserve_decode_pages():
            n = len(req.tokens)
            chunks.append(SequenceChunk(token_ids=[req.tokens[-1]], prefix_len=n - 1, pages=list(req.kv.pages)))
            scheduled.append(req)
        prefill_budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            tokens = req.tokens
            fits_budget = len(tokens) <= prefill_budget or prefill_budget == self.max_prefill_tokens
            if not fits_budget or req.kv.pages_needed(len(tokens)) > self.allocator.num_free:
                break
            self.waiting.popleft()
            req.kv.reserve(len(tokens))
            prefill_budget -= len(tokens)
            self.running.append(req)
            chunks.append(SequenceChunk(token_ids=tokens, prefix_len=0, pages=list(req.kv.pages)))
            scheduled.append(req)
        if not chunks:
            return None
        return ScheduledStep(ForwardBatch(chunks, capture_features=capture_features), scheduled)

    def _reserve_decode_pages(self) -> list[Request]:
        """Give every running request room for one more token, preempting the newest ones if needed."""
        ready: list[Request] = []
        for req in list(self.running):
            if req not in self.running:  # preempted while making room for an older request
                continue
            while req.kv.pages_needed(len(req.tokens)) > self.allocator.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req in self.running:
                req.kv.reserve(len(req.tokens))
                ready.append(req)
        return ready

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
