"""The prefix cache's pages (tandem.prefix_cache with the page allocator and the scheduler), model-free:
block keys name whole prefixes; and a property-based run of the scheduler over requests that share
prefixes, with speculative widths, chunked prefill, preemption and eviction, where every slot's content
is tracked — every forward reads exactly its own tokens' KV, no write lands in a cached page, and after
every step each page is free, cached or owned by one sequence, with reference counts that match the
sequences holding it and only unreferenced pages evictable."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.errors import OutOfPagesError
from tandem.kv_cache import PageAllocator, SequenceKV
from tandem.prefix_cache import PrefixCache, block_keys, draft_page_key
from tandem.sampling import SamplingParams


def test_a_block_key_names_the_whole_prefix():
    a, b = [5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 10, 12]
    ka, kb = block_keys(a, 2), block_keys(b, 2)
    assert len(ka) == 3 and ka == kb  # the differing token is in no full block
    assert block_keys([1, 6, 7, 8], 2)[1] != ka[1]  # same block, another prefix: another key
    assert block_keys(a, 2, ka[:1]) == ka and block_keys(a, 2, limit=2) == ka[:2]  # from keys known, up to a limit
    assert block_keys([2**40, 1], 2) != block_keys([0, 1], 2)  # token ids are not truncated
    # The head's page p also covers the token after block p (its last entry pairs it with the feature).
    assert draft_page_key(ka[0], 7) == draft_page_key(kb[0], 7) != draft_page_key(ka[0], 8)


def test_allocation_evicts_unreferenced_cached_pages_least_recent_first():
    cache = PrefixCache(2)
    alloc = PageAllocator(6, 2, cache=cache)  # pages 1..5
    seq = SequenceKV(alloc)
    seq.reserve(6)
    seq.num_tokens = 6
    keys = block_keys([1, 2, 3, 4, 5, 6], 2)
    cache.insert(keys, seq.full_pages)
    pages = list(seq.pages)
    seq.release()  # cached, unreferenced: the tail first in eviction order
    assert alloc.num_free == 5 and cache.num_evictable == 3
    held = SequenceKV(alloc)
    held.adopt(cache.match(keys[:1]))  # page 0 of the chain is referenced again
    assert cache.refs(pages[0]) == 1 and alloc.num_free == 4
    other = SequenceKV(alloc)
    other.reserve(2 * 4)  # 2 free pages, then the tail's two cached pages
    assert set(other.pages) == {p for p in range(1, 6) if p not in pages} | {pages[2], pages[1]}
    assert cache.stats.evictions == 2 and cache.holds(pages[0])
    try:
        SequenceKV(alloc).reserve(2)
    except OutOfPagesError:
        pass
    else:
        raise AssertionError("a referenced cached page was evicted")
    held.release()
    other.release()
    assert alloc.num_free == alloc.capacity_pages


BASES = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5, 6, 20, 21, 22, 23], [30, 31, 32, 33, 34, 35]]


class Simulation:
    """The scheduler driven as the engine drives it, with each KV slot's content tracked as the prefix
    (token ids 0..t) that wrote it."""

    def __init__(self, page_size: int, num_pages: int, max_running: int, chunk: int, seed: int):
        self.ps = page_size
        self.cache = PrefixCache(page_size)
        self.alloc = PageAllocator(num_pages, page_size, shuffle_seed=seed, cache=self.cache)
        self.sched = Scheduler(self.alloc, max_running, chunk)
        self.content: dict[int, tuple[int, ...]] = {}
        self.rng = random.Random(seed)
        self.live: list[Request] = []
        self.count = 0

    def add(self, base: int, cut: int, suffix: list[int], max_new: int) -> None:
        prompt = BASES[base][: max(1, cut)] + suffix
        req = Request(f"r{self.count}", prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True), None,
                      SequenceKV(self.alloc))
        self.count += 1
        try:
            self.sched.add(req)
        except OutOfPagesError:
            return
        self.live.append(req)

    def _read(self, req: Request, upto: int) -> None:
        tokens = req.tokens
        for t in range(upto):
            assert self.content.get(req.kv.slot(t)) == tuple(tokens[: t + 1]), f"{req.rid} reads another's KV at {t}"

    def _write(self, req: Request, t: int, prefix: tuple[int, ...] | None) -> None:
        page = req.kv.pages[t // self.ps]
        assert not self.cache.holds(page), f"{req.rid} writes into cached page {page}"
        self.content[req.kv.slot(t)] = prefix

    def _ends(self, req: Request) -> bool:
        """The engine's length rules: max_new_tokens, or a next step past the whole KV cache."""
        return (len(req.output) >= req.params.max_new_tokens
                or self.alloc.pages_for(req.num_tokens) > self.alloc.capacity_pages)

    def step(self, width: int) -> None:
        sched = self.sched.schedule(lambda r: width)
        assert sched or not self.sched.waiting, "the scheduler made no progress with requests waiting"
        done = []
        for p in sched.prefill:
            req = p.req
            self._read(req, p.start)
            tokens = req.tokens
            for t in range(p.start, p.end):
                self._write(req, t, tuple(tokens[: t + 1]))
            if p.last:
                req.output.append(self.rng.randrange(3, 40))
                if self._ends(req):
                    done.append(req)
                else:
                    req.kv.truncate(req.num_tokens - 1)
                    self.sched.cache_committed(req)
            else:
                req.kv.commit(p.end)
        for req in sched.decode:
            committed = req.num_tokens - 1
            self._read(req, committed)
            self._write(req, committed, tuple(req.tokens))  # the root
            for i in range(1, width):  # draft nodes: KV of tokens that may be rejected
                self._write(req, committed + i, None)
            accepted = [self.rng.randrange(3, 40) for _ in range(self.rng.randrange(width))]
            for i, token in enumerate(accepted, start=1):  # compacted to committed + 1, 2, ...
                self._write(req, committed + i, tuple(req.tokens) + tuple(accepted[:i]))
            for token in accepted + [self.rng.randrange(3, 40)]:
                req.output.append(token)
                if self._ends(req):
                    break
            if self._ends(req):
                done.append(req)
            else:
                req.kv.truncate(req.num_tokens - 1)
        for req in done:
            req.kv.commit(req.num_tokens - 1)
            self.sched.finish(req)
            self.live.remove(req)

    def check(self) -> None:
        free = list(self.alloc._free)
        assert len(free) == len(set(free)) and 0 not in free
        holders: dict[int, list[str]] = {}
        for req in self.live:
            assert 0 not in req.kv.pages
            for page in req.kv.pages:
                holders.setdefault(page, []).append(req.rid)
        cached = set(self.cache._key_of)
        assert not set(free) & cached and not set(free) & set(holders)
        for page, rids in holders.items():
            assert len(rids) == len(set(rids))
            if page not in cached:
                assert len(rids) == 1, f"uncached page {page} shared by {rids}"
        for page in cached:
            assert self.cache.refs(page) == len(holders.get(page, [])), f"page {page}: refs != holders"
        assert set(self.cache._idle) == {p for p in cached if self.cache.refs(p) == 0}
        assert set(free) | cached | set(holders) == set(range(1, self.alloc.num_pages))
        assert self.alloc.num_free == len(free) + self.cache.num_evictable


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_the_scheduler_shares_pages_correctly_under_eviction_and_preemption(data):
    sim = Simulation(page_size=data.draw(st.sampled_from([1, 2, 4]), "page"),
                     num_pages=data.draw(st.integers(6, 24), "pages"), max_running=data.draw(st.integers(1, 4)),
                     chunk=data.draw(st.sampled_from([-1, 3, 8])), seed=data.draw(st.integers(0, 99)))
    for _ in range(data.draw(st.integers(1, 30), "steps")):
        if data.draw(st.booleans()):
            sim.add(data.draw(st.integers(0, len(BASES) - 1)), data.draw(st.integers(1, 10)),
                    data.draw(st.lists(st.integers(3, 40), max_size=4)), data.draw(st.integers(1, 10)))
        if sim.sched.has_work():
            sim.step(data.draw(st.integers(1, 4), "width"))
        sim.check()
    while sim.sched.has_work():
        sim.step(1)
        sim.check()
    assert sim.alloc.num_free == sim.alloc.capacity_pages
    assert all(sim.cache.refs(p) == 0 for p in range(sim.alloc.num_pages))
