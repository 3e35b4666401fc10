"""Scheduler: which requests run in the next forward, and the KV pages they need.

Every step runs all running requests (decode: their last token, or a draft tree rooted at it)
together with newly admitted prompts (prefill), packed into one forward. A prompt is admitted only
when its pages fit now; when a running request cannot get pages for its next step, the most recently
admitted request is preempted: its pages are freed and it goes back to the front of the queue, to be
recomputed from its tokens later (its output so far is kept, so nothing is lost and greedy output is
unchanged).

Prompts share a per-step token budget (``--chunked-prefill-size``): a prompt longer than what is left of
it is prefilled in chunks over several steps, beside the decoding requests, so a long prompt does not
stall them. A prompt in chunked prefill stays at the head of the queue holding the pages of its chunks
done so far (``req.kv.num_tokens``: the tokens already in the KV cache); it joins the running batch with
its last chunk, which samples its first token. It is the first to be preempted when a running request
cannot grow (it is the most recently admitted), and a new prompt starts only when all of it fits now.

With a prefix cache (tandem.prefix_cache), a prompt starts on the longest run of its full pages found
cached (always leaving its last token to compute, which samples the first output token) and is
prefilled from there, like a chunk after earlier chunks; a prompt's full pages enter the cache once it
is prefilled, and a request that finishes or is preempted leaves all its full committed pages there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tandem.engine.config import DEFAULT_CHUNKED_PREFILL_SIZE
from tandem.engine.request import Request
from tandem.engine.request_sampling import cacheable_prompt_tokens
from tandem.errors import OutOfPagesError
from tandem.kv_cache import PageAllocator
from tandem.prefix_cache import block_keys


@dataclass(frozen=True)
class Prefill:
    """Tokens ``start:end`` of a request's sequence, prefilled this step (its whole prompt, or a chunk)."""
    req: Request
    start: int  # tokens already in the KV cache (earlier chunks): the chunk's prefix
    end: int
    last: bool  # the prompt's last chunk: it samples the request's next token (fixed here: the sequence grows)


@dataclass
class Schedule:
    decode: list[Request] = field(default_factory=list)  # running; pages reserved for their step width
    prefill: list[Prefill] = field(default_factory=list)  # prompts or chunks; pages reserved up to their end
    preempted: list[Request] = field(default_factory=list)  # sent back to the queue this step

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_running: int, chunked_prefill_size: int):
        """``chunked_prefill_size``: prompt tokens prefilled per step; -1: prompts are not cut (they go
        whole, one longer than the default budget alone). The allocator's ``cache``, if any, is the prefix
        cache prompts start on."""
        self.allocator = allocator
        self.cache = allocator.cache
        self.max_running = max_running
        self.chunked = chunked_prefill_size > 0
        self.prefill_budget = chunked_prefill_size if self.chunked else DEFAULT_CHUNKED_PREFILL_SIZE
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0  # since start, every request's (metrics read the difference)

    def add(self, request: Request) -> None:
        needed = self.allocator.pages_for(len(request.prompt) + 1)
        if needed > self.allocator.capacity_pages:
            raise OutOfPagesError(
                f"the prompt needs {needed} KV pages and the whole KV cache has {self.allocator.capacity_pages} for "
                f"requests: it can never fit; shorten it"
            )
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def running_exactly(self, reqs: list[Request]) -> bool:
        """Whether the running requests are ``reqs``, the same objects in the same order: the batch a run
        queued on the device (tandem.engine.decode_ahead, rounds_ahead) was queued for."""
        return len(self.running) == len(reqs) and all(a is b for a, b in zip(self.running, reqs))

    def can_admit(self) -> bool:
        """Whether the head of the queue could be prefilled now (the rest of a prompt in chunked prefill,
        or a new prompt whose pages fit): while it can, runs queued ahead stay short."""
        if not self.waiting or len(self.running) >= self.max_running:
            return False
        head = self.waiting[0]
        return bool(head.kv.pages) or head.kv.pages_needed(head.num_tokens) <= self.allocator.num_free

    def schedule(self, step_width: Callable[[Request], int] = lambda r: 1, decode: bool = True,
                 admit: bool = True, chunk_cap: int | None = None) -> Schedule:
        """Reserve pages for every running request's next step (``step_width`` new tokens after its
        committed ones: 1 for plain decoding, the tree size when it speculates), then admit prompts.
        ``decode=False``: a step of prompts alone (the running requests sit it out; their next step's
        pages stay free for them); ``admit=False``: of running requests alone."""
        out = Schedule()
        for req in list(self.running) if decode else []:
            if req not in self.running:  # preempted while making room for an older request
                continue
            needed_tokens = req.num_tokens - 1 + step_width(req)
            while req.kv.pages_needed(needed_tokens) > self.allocator.num_free:
                partial = self._in_prefill()
                if partial is not None:  # the most recently admitted: its chunks are recomputed later
                    self._release(partial)
                    partial.num_preemptions += 1
                    self.preemptions += 1
                    out.preempted.append(partial)
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req in self.running:
                req.kv.reserve(needed_tokens)
                out.decode.append(req)
        held = 0 if decode else sum(req.kv.pages_needed(req.num_tokens - 1 + step_width(req)) for req in self.running)
        budget = self.prefill_budget if admit else 0
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            req = self.waiting[0]
            fresh = not req.kv.pages  # not started (or preempted): it may start on cached pages
            if fresh:
                self._start_on_cache(req)
            start, n = req.kv.num_tokens, req.num_tokens
            if self.chunked:  # (chunk_cap: one prompt's most while requests decode: tandem.engine.prefill_pace)
                end = min(n, start + (budget if chunk_cap is None else min(budget, chunk_cap)))
            elif n - start <= budget or budget == self.prefill_budget:  # one long prompt always may go
                end = n
            else:
                break
            needed = req.kv.pages_needed(n if fresh else end)  # a new prompt starts only if it all fits
            if needed > self.allocator.num_free - held:
                if fresh:  # it waits holding nothing
                    req.kv.release()
                break
            req.kv.reserve(end)
            if fresh:
                self._started(req)
            budget -= end - start
            out.prefill.append(Prefill(req, start, end, last=end == n))
            if end < n:  # the rest goes in later steps; the request keeps the head of the queue
                break
            self.waiting.popleft()
            self.running.append(req)
        return out

    def _start_on_cache(self, req: Request) -> None:
        """Adopt the request's longest cached run of full pages, leaving at least its last token to compute, and
        every position whose logits give a prompt entry it asks for (prompt_logprobs, from prompt_logprobs_from)."""
        req.prefix_hit = 0
        if self.cache is not None:
            usable = cacheable_prompt_tokens(req) // self.allocator.page_size
            keys = block_keys(req.tokens, self.allocator.page_size, req.block_keys, salt=req.cache_salt)[:usable]
            pages = self.cache.match(keys)
            if pages:
                req.kv.adopt(pages)
                req.prefix_hit = req.kv.num_tokens

    def _started(self, req: Request) -> None:
        if self.cache is not None:
            self.cache.record(req.num_tokens, req.prefix_hit)
        if req.cached_tokens is None:  # usage reports the first admission's
            req.cached_tokens = req.prefix_hit

    def cache_committed(self, req: Request) -> None:
        """Put the request's full committed pages in the prefix cache now (a prompt just prefilled: later
        prompts that start the same way share them while it decodes; it keeps writing only past them)."""
        if self.cache is not None and req.kv.num_tokens:
            full = req.kv.full_pages
            keys = block_keys(req.tokens, self.allocator.page_size, req.block_keys, salt=req.cache_salt)
            self.cache.insert(keys[: len(full)], full)

    def _release(self, req: Request) -> None:
        """Free the request's pages, leaving its full committed ones in the prefix cache."""
        self.cache_committed(req)
        req.kv.release()

    def _in_prefill(self) -> Request | None:
        """The prompt part-way through a chunked prefill (it holds pages while it waits), or None."""
        head = self.waiting[0] if self.waiting else None
        return head if head is not None and head.kv.pages else None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_preemptions += 1
        self.preemptions += 1
        self.waiting.insert(1 if self._in_prefill() is not None else 0, req)  # behind a prompt mid-prefill

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
