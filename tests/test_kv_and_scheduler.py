"""The paged KV allocator and the scheduler: page accounting, out-of-pages errors, preemption under a
small cache (outputs unchanged), admission limits, abort, and every page back at the end."""

from __future__ import annotations

import pytest

from helpers import greedy_alone, random_prompt
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.errors import OutOfPagesError, TandemError
from tandem.kv_cache import DUMMY_PAGE, PageAllocator, SequenceKV
from tandem.sampling import SamplingParams

# --------------------------------------------------------------------------------------- allocator


def test_allocator_counts_and_reuse():
    alloc = PageAllocator(10, page_size=4)
    assert alloc.capacity_pages == 9 and alloc.num_free == 9
    a = alloc.allocate(3)
    b = alloc.allocate(6)
    assert alloc.num_free == 0
    assert len(set(a) | set(b)) == 9 and DUMMY_PAGE not in a + b
    assert set(a + b) == set(range(1, 10))
    alloc.free(a)
    assert alloc.num_free == 3
    assert sorted(alloc.allocate(3)) == sorted(a)
    alloc.free(a)
    alloc.free(b)
    assert alloc.num_free == 9
    assert alloc.allocate(0) == []


def test_out_of_pages_message_names_the_numbers():
    alloc = PageAllocator(10, page_size=4)
    alloc.allocate(6)
    with pytest.raises(OutOfPagesError) as info:
        alloc.allocate(7)
    msg = str(info.value)
    assert "\n" not in msg
    for number in ("7", "3", "9", "4"):  # needed, free, capacity, page size
        assert number in msg, msg
    assert alloc.num_free == 3  # a failed allocation takes nothing


def test_allocator_needs_a_page_beyond_the_dummy():
    with pytest.raises(OutOfPagesError):
        PageAllocator(1, page_size=16)


def test_shuffled_allocator_hands_out_the_same_pages_in_another_order():
    plain, shuffled = PageAllocator(50, 4), PageAllocator(50, 4, shuffle_seed=123)
    a, b = plain.allocate(49), shuffled.allocate(49)
    assert sorted(a) == sorted(b) == list(range(1, 50))
    assert a != b


def test_sequence_kv_slots_and_truncate():
    alloc = PageAllocator(20, page_size=4, shuffle_seed=3)
    kv = SequenceKV(alloc)
    kv.reserve(10)
    assert len(kv.pages) == 3 and alloc.num_free == 16
    for t in range(10):
        assert kv.slot(t) == kv.pages[t // 4] * 4 + t % 4
    kv.reserve(12)  # still 3 pages
    assert len(kv.pages) == 3
    kv.reserve(13)
    assert len(kv.pages) == 4 and alloc.num_free == 15
    kept = kv.pages[:2]
    kv.truncate(5)
    assert kv.pages == kept and kv.num_tokens == 5 and alloc.num_free == 17
    kv.release()
    assert kv.pages == [] and alloc.num_free == 19


def test_commit_keeps_the_pages_a_queued_run_writes_into():
    """SequenceKV.commit (overlapped runs): the committed count moves, every reserved page stays; a count
    the pages cannot hold is refused; the next truncate gives the pages past it back."""
    alloc = PageAllocator(20, page_size=4, shuffle_seed=3)
    kv = SequenceKV(alloc)
    kv.reserve(13)
    pages = list(kv.pages)
    kv.commit(6)
    assert kv.num_tokens == 6 and kv.pages == pages and alloc.num_free == 15
    with pytest.raises(ValueError):
        kv.commit(17)
    kv.truncate(kv.num_tokens)
    assert kv.pages == pages[:2] and alloc.num_free == 17


def test_page_table_mirrors_the_pages_through_growth_and_truncation():
    import random

    alloc = PageAllocator(400, page_size=4, shuffle_seed=1)
    kv, rng = SequenceKV(alloc), random.Random(0)
    for _ in range(300):  # grows past the array's first capacities, shrinks, regrows over old entries
        if rng.random() < 0.7:
            kv.reserve(kv.num_tokens + rng.randrange(1, 40))
            kv.num_tokens = len(kv.pages) * 4
        else:
            kv.truncate(rng.randrange(0, kv.num_tokens + 1))
        table = kv.page_table()
        assert table.dtype.name == "int32" and table.tolist() == kv.pages
        view = kv.page_table(copy=False)
        assert view.tolist() == kv.pages
    kv.reserve(kv.num_tokens + 8)
    held, expected = kv.page_table(), list(kv.pages)
    kv.truncate(0)
    kv.reserve(4 * len(expected))  # the mirror is rewritten with other pages...
    assert kv.page_table().tolist() != expected
    assert held.tolist() == expected  # ...but a table taken before (a forward's) keeps its own


# ------------------------------------------------------------------------------------------ engine


def test_prompt_larger_than_the_whole_cache(llama):
    # 5 pages of 4 tokens, one reserved: room for 16 tokens. A prompt needs its tokens + 1.
    with LLMEngine(EngineConfig(model=llama.path, kv_pages=5, page_size=4)) as eng:
        assert eng.allocator.capacity_pages == 4
        with pytest.raises(OutOfPagesError) as info:
            eng.add_request(random_prompt(1, 16), SamplingParams(max_new_tokens=1))
        msg = str(info.value)
        assert "\n" not in msg and "5" in msg and "4" in msg, msg
        assert eng.requests == {} and not eng.has_unfinished()
        # The engine still serves a prompt that fits.
        prompt = random_prompt(2, 15)
        [r] = eng.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))
        assert r.output_token_ids == greedy_alone(llama.path, prompt, 1)
        assert eng.allocator.num_free == eng.allocator.capacity_pages


def check_page_invariants(eng: LLMEngine) -> None:
    """No page is owned twice, the dummy page is never owned, and owned + free == capacity."""
    owned = [p for req in eng.requests.values() for p in req.kv.pages]
    assert len(owned) == len(set(owned)), "a KV page is owned by two requests"
    assert DUMMY_PAGE not in owned
    assert len(owned) + eng.allocator.num_free == eng.allocator.capacity_pages
    assert len(eng.scheduler.running) <= eng.scheduler.max_running


def run_to_completion(eng: LLMEngine, rids: list[str], max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if all(eng.requests[r].finished for r in rids):
            return
        eng.step()
        check_page_invariants(eng)
    raise AssertionError(f"requests not finished after {max_steps} steps")


PREEMPT_LENGTHS = [6, 9, 5, 8]
PREEMPT_NEW = [20, 18, 22, 16]


@pytest.mark.parametrize("page_shuffle_seed", [None, 9])
def test_small_cache_preempts_and_outputs_are_unchanged(llama, page_shuffle_seed):
    prompts = [random_prompt(10 + i, n) for i, n in enumerate(PREEMPT_LENGTHS)]
    want = [greedy_alone(llama.path, p, n) for p, n in zip(prompts, PREEMPT_NEW)]
    # 12 usable pages of 4 tokens = 48 tokens; the four requests need 26 + 27 + 27 + 24.
    cfg = EngineConfig(model=llama.path, kv_pages=13, page_size=4, page_shuffle_seed=page_shuffle_seed)
    with LLMEngine(cfg) as eng:
        rids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                for p, n in zip(prompts, PREEMPT_NEW)]
        run_to_completion(eng, rids)
        reqs = [eng.requests.pop(r) for r in rids]
        assert sum(r.num_preemptions for r in reqs) > 0, "the cache was small enough to force preemption"
        assert [r.output for r in reqs] == want
        assert all(r.finish_reason.value == "length" for r in reqs)
        assert eng.allocator.num_free == eng.allocator.capacity_pages
        assert not eng.has_unfinished()


def test_seeded_sampling_unchanged_by_preemption(llama):
    prompts = [random_prompt(20 + i, n) for i, n in enumerate(PREEMPT_LENGTHS)]
    params = [SamplingParams(temperature=1.0, top_k=20, seed=1000 + i, max_new_tokens=n, ignore_eos=True)
              for i, n in enumerate(PREEMPT_NEW)]
    want = []
    for p, sp in zip(prompts, params):
        with LLMEngine(EngineConfig(model=llama.path)) as alone:
            want.append(alone.generate([p], sp)[0].output_token_ids)
    with LLMEngine(EngineConfig(model=llama.path, kv_pages=13, page_size=4)) as eng:
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        run_to_completion(eng, rids)
        reqs = [eng.requests.pop(r) for r in rids]
    assert sum(r.num_preemptions for r in reqs) > 0
    assert [r.output for r in reqs] == want


def test_max_running_requests_limits_the_batch(llama):
    prompts = [random_prompt(30 + i, 4 + 3 * i) for i in range(5)]
    want = [greedy_alone(llama.path, p, 8) for p in prompts]
    with LLMEngine(EngineConfig(model=llama.path, max_running_requests=2)) as eng:
        rids = [eng.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in prompts]
        peak = 0
        for _ in range(200):
            if all(eng.requests[r].finished for r in rids):
                break
            eng.step()
            peak = max(peak, len(eng.scheduler.running))
            check_page_invariants(eng)
        assert peak == 2
        assert [eng.requests.pop(r).output for r in rids] == want
        assert eng.allocator.num_free == eng.allocator.capacity_pages


def test_prefill_token_budget(llama):
    """chunked_prefill_size bounds the prompt tokens prefilled per step: a prompt past what is left of it
    is cut into chunks over several steps (tests/test_chunked_prefill.py has the rest); outputs are unchanged."""
    lengths = [4, 5, 6, 20, 3]
    prompts = [random_prompt(35 + i, n) for i, n in enumerate(lengths)]
    want = [greedy_alone(llama.path, p, 6) for p in prompts]
    with LLMEngine(EngineConfig(model=llama.path, chunked_prefill_size=10)) as eng:
        rids = [eng.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in prompts]
        spans = []
        real = eng.scheduler.schedule

        def schedule(*args, **kwargs):
            sched = real(*args, **kwargs)
            spans.append(sched.prefill)
            return sched

        eng.scheduler.schedule = schedule
        while not all(eng.requests[r].finished for r in rids):
            eng.step()
            check_page_invariants(eng)
        assert all(sum(p.end - p.start for p in step) <= 10 for step in spans)
        assert [(p.start, p.end) for step in spans for p in step if p.req.rid == rids[3]] == [(0, 5), (5, 15), (15, 20)]
        assert [eng.requests.pop(r).output for r in rids] == want


def test_abort_of_a_waiting_request(llama):
    with LLMEngine(EngineConfig(model=llama.path)) as eng:
        rid = eng.add_request(random_prompt(45, 7), SamplingParams(max_new_tokens=5))
        eng.abort(rid)
        assert rid not in eng.requests and not eng.has_unfinished()
        assert eng.step() == []
        assert eng.allocator.num_free == eng.allocator.capacity_pages


def test_abort_frees_pages_and_others_continue(llama):
    prompts = [random_prompt(40, 12), random_prompt(41, 30)]
    want = greedy_alone(llama.path, prompts[1], 12)
    with LLMEngine(EngineConfig(model=llama.path, page_size=4)) as eng:
        a = eng.add_request(prompts[0], SamplingParams(max_new_tokens=50, ignore_eos=True))
        b = eng.add_request(prompts[1], SamplingParams(max_new_tokens=12, ignore_eos=True))
        for _ in range(3):
            eng.step()
        held = len(eng.requests[a].kv.pages)
        assert held > 0
        free_before = eng.allocator.num_free
        eng.abort(a)
        assert a not in eng.requests
        assert eng.allocator.num_free == free_before + held
        run_to_completion(eng, [b])
        assert eng.requests.pop(b).output == want
        assert eng.allocator.num_free == eng.allocator.capacity_pages
        assert not eng.has_unfinished()


def test_request_outgrowing_the_whole_cache_does_not_wedge_the_engine(llama):
    """A request whose prompt fits but whose prompt + max_new_tokens exceeds the entire KV cache must
    either be refused up front (a one-line TandemError) or end with finish_reason 'length' when the
    cache is full; either way the other requests must still be served (docs/architecture.md, "Invariants")."""
    big, small = random_prompt(50, 10), random_prompt(51, 3)
    want_small = greedy_alone(llama.path, small, 3)
    # 4 usable pages of 4 tokens: 16 tokens in all.
    with LLMEngine(EngineConfig(model=llama.path, kv_pages=5, page_size=4)) as eng:
        try:
            big_rid = eng.add_request(big, SamplingParams(max_new_tokens=20, ignore_eos=True))
        except TandemError as e:
            assert "\n" not in str(e)
            big_rid = None
        small_rid = eng.add_request(small, SamplingParams(max_new_tokens=3, ignore_eos=True))
        rids = [small_rid] + ([big_rid] if big_rid else [])
        for _ in range(100):
            if all(eng.requests[r].finished for r in rids):
                break
            eng.step()
        assert eng.requests[small_rid].finished
        assert eng.requests[small_rid].output == want_small
        if big_rid is not None:
            req = eng.requests[big_rid]
            assert req.finished and req.finish_reason.value == "length"
            expected = greedy_alone(llama.path, big, 20)
            assert req.output == expected[: len(req.output)] and len(req.output) >= 1
        for r in rids:
            eng.requests.pop(r)
        assert eng.allocator.num_free == eng.allocator.capacity_pages
