"""The prefix cache in the engine: greedy output identical to the engine with the cache off, whatever the
chunk size, target-only and speculative (chains and trees); a request on a cached prefix speculates from
its first round with the drafter's KV as a whole-prompt prefill builds it, and the same acceptance;
seeded sampling unchanged; preemption under a small KV cache; every page back at the end."""

from __future__ import annotations

import pytest
import torch

from draft_checkpoints import pair_engine
from helpers import random_prompt
from tandem.engine.llm_engine import LLMEngine
from tandem.forward_batch import SequenceChunk
from tandem.sampling import SamplingParams
from tandem.speculative.drafter import Eagle3Drafter
from tandem.speculative.spec_config import SpecConfig

PAGE = 4
SYSTEM = random_prompt(500, 23)  # a shared prefix that ends inside a page
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


def engine(pair, chunk: int = -1, spec: SpecConfig | None = None, cache: bool = True, draft_page: int = PAGE,
           **kw) -> LLMEngine:
    return pair_engine(pair, spec, draft_page_size=draft_page, page_size=PAGE, chunked_prefill_size=chunk,
                       enable_prefix_caching=cache, page_shuffle_seed=3, **kw)


def conversation(eng: LLMEngine, params=GREEDY) -> tuple[list[list[int]], list]:
    """Three waves: two prompts on a shared system prompt, the second arriving once the first is prefilled
    (which decodes meanwhile); two more on it while another request decodes; then a second turn of each
    first-wave conversation (its prompt, its answer, a new message). → outputs in arrival order, and the
    requests (for their cached counts and speculation stats)."""
    done = []

    def run(prompts, overlap=False):
        rids = []
        for prompt in prompts:
            rids.append(eng.add_request(prompt, params))
            while not eng.requests[rids[-1]].output:  # prefilled (in chunks or not): the next one arrives
                eng.step()
        while any(not eng.requests[r].finished for r in rids) and not (overlap and eng.requests[rids[0]].output):
            eng.step()
        return rids

    first = run([SYSTEM + random_prompt(501, 9), SYSTEM + random_prompt(502, 14)])
    late = run([random_prompt(503, 6)], overlap=True)  # still decoding while the next wave arrives
    second = run([SYSTEM + random_prompt(504, 3), SYSTEM[:17] + random_prompt(505, 11)])
    turns = [eng.requests[r].prompt + eng.requests[r].output + random_prompt(506 + i, 7) for i, r in enumerate(first)]
    third = run(turns)
    while eng.has_unfinished():
        eng.step()
    assert eng.allocator.num_free == eng.allocator.capacity_pages  # every page free or evictable
    for rid in first + late + second + third:
        done.append(eng.requests.pop(rid))
    return [r.output for r in done], done


@pytest.fixture(scope="module")
def reference(pair):
    with engine(pair, cache=False) as eng:
        outputs, reqs = conversation(eng)
    assert all(r.cached_tokens == 0 for r in reqs)
    return outputs


@pytest.mark.parametrize("chunk", [-1, 4, 7, 16])
def test_target_only_greedy_is_unchanged_by_the_cache(pair, reference, chunk):
    with engine(pair, chunk) as eng:
        outputs, reqs = conversation(eng)
        assert eng.prefix_cache.stats.hits > 0
    assert outputs == reference
    cached = [r.cached_tokens for r in reqs]
    assert cached[:3] == [0, 20, 0]  # the second prompt finds the first's full pages of the system prompt
    assert cached[3] == 20 and cached[4] == 16  # a shorter shared prefix: its full pages
    for turn, earlier in zip(reqs[5:], reqs[:2]):  # a second turn: the full pages of the first's committed tokens
        assert turn.cached_tokens == (earlier.num_tokens - 1) // PAGE * PAGE
    assert all(c % PAGE == 0 and c < len(r.prompt) for c, r in zip(cached, reqs))


@pytest.mark.parametrize("spec,chunk", [(SpecConfig(3, 1, 4), -1), (SpecConfig(3, 1, 4), 7),
                                        (SpecConfig(3, 2, 6), 4), (SpecConfig(2, 3, 7), 16)])
def test_speculative_greedy_is_unchanged_and_cached_requests_speculate_as_without(pair, reference, spec, chunk):
    runs = {}
    for cache in (False, True):
        with engine(pair, chunk, spec, cache=cache) as eng:
            outputs, reqs = conversation(eng)
            runs[cache] = (outputs, reqs)
            if cache:
                assert eng.proposer.prefix_cache.stats.hits > 0
    assert runs[True][0] == runs[False][0] == reference
    for with_cache, without in zip(runs[True][1], runs[False][1]):
        # Speculating at once, with the acceptance of a drafter that saw the whole prompt.
        assert with_cache.spec_stats.rounds == without.spec_stats.rounds > 0
        assert with_cache.spec_stats.accepted_per_round == without.spec_stats.accepted_per_round


def _draft_kv(drafter: Eagle3Drafter, rid: str) -> torch.Tensor:
    """The head's committed KV of ``rid`` in token order: [entries, tokens, heads, dim]."""
    state = drafter.request_states([rid])[0]
    slots = torch.tensor([state.kv.slot(t) for t in range(state.kv.num_tokens)])
    flat = drafter.kv.data.flatten(2, 3)  # [entries, layers, slots, heads, dim]
    return flat[:, 0].index_select(1, slots)


@pytest.mark.parametrize("draft_page", [PAGE, 3, 8])
def test_the_drafter_starts_on_the_cached_prefix_with_the_kv_of_a_whole_prefill(pair, draft_page):
    """Whatever the head's page size against the target's: it finds its full pages of the cached tokens."""
    spec = SpecConfig(3, 1, 4)
    first, second = SYSTEM + random_prompt(510, 5), SYSTEM + random_prompt(511, 8)
    with engine(pair, spec=spec, cache=False) as eng:
        rid = eng.add_request(second, GREEDY)
        eng.step()  # the prefill: the drafter gets the whole prompt
        expected = _draft_kv(eng.proposer, rid)
    with engine(pair, spec=spec, draft_page=draft_page) as eng:
        eng.generate([first], GREEDY)
        rid = eng.add_request(second, GREEDY)
        eng.step()
        assert eng.requests[rid].cached_tokens == 20
        # The head's full pages of those 20 tokens, found (the rest rebuilt from zero features).
        assert eng.proposer.prefix_cache.stats.hits == 20 // draft_page * draft_page
        if 20 % draft_page == 0:
            assert not eng.proposer.request_states([rid])[0].zero_pages
        got = _draft_kv(eng.proposer, rid)
    assert got.shape == expected.shape == (2, len(second), *expected.shape[2:])
    found = 20 // draft_page * draft_page
    torch.testing.assert_close(got[:, :found], expected[:, :found], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[:, 20:], expected[:, 20:], rtol=1e-4, atol=1e-5)  # computed after the prefix


def test_a_drafter_miss_falls_back_to_zero_features_and_output_stays_exact(pair, reference):
    """The head's cached pages missing (evicted there, here: never found) while the target's are found:
    requests on the cached prefix draft from what the head rebuilt without features; every token is still
    the target's."""
    spec = SpecConfig(3, 2, 6)
    with engine(pair, spec=spec) as eng:
        eng.proposer.prefix_cache.match = lambda keys: []
        outputs, reqs = conversation(eng)
        assert eng.prefix_cache.stats.hits > 0
        assert eng.proposer.prefix_cache.stats.queries > 0 and eng.proposer.prefix_cache.stats.hits == 0
        assert eng.allocator.num_free == eng.allocator.capacity_pages
        assert eng.proposer.allocator.num_free == eng.proposer.allocator.capacity_pages
    assert outputs == reference
    assert all(r.spec_stats.rounds > 0 for r in reqs)


def test_seeded_sampling_is_unchanged_by_the_cache(pair):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=17, max_new_tokens=8, ignore_eos=True)
    outs = []
    for cache, spec in ((False, None), (True, None), (False, SpecConfig(3, 2, 6)), (True, SpecConfig(3, 2, 6))):
        with engine(pair, 7, spec, cache=cache) as eng:
            outs.append(conversation(eng, params)[0])
    assert outs[0] == outs[1]
    assert outs[2] == outs[3]


def test_preemption_under_a_small_kv_cache_keeps_output_and_pages(pair, reference):
    """So few pages that requests are preempted and cached pages evicted: outputs unchanged, and at the
    end every page is free or cached with no holder."""
    with engine(pair, 8, kv_pages=1 + 24) as eng:
        outputs, _ = conversation(eng)
        assert eng.scheduler.preemptions > 0 and eng.prefix_cache.stats.evictions > 0
        assert all(eng.prefix_cache.refs(p) == 0 for p in range(1, eng.allocator.num_pages))
    assert outputs == reference


def test_disable_prefix_caching_flag_reaches_the_engine(pair):
    from tandem.cli import build_parser, generate_settings
    from verifier.__main__ import build_parser as verifier_parser
    from verifier.config import VerifierConfig

    for flags, enabled in (([], True), (["--disable-prefix-caching"], False)):
        args = verifier_parser().parse_args(["--model", str(pair.target_dir), *flags])
        assert VerifierConfig.from_args(args, args.model).engine.enable_prefix_caching is enabled
        cfg, _ = generate_settings(build_parser().parse_args(["generate", "--prompt-token-ids", "1", "--max-new-tokens", "1", "--model",
                                                              str(pair.target_dir), *flags]))
        assert cfg.enable_prefix_caching is enabled


def test_pages_the_drafter_rebuilt_without_features_are_never_cached(pair):
    """A head page missing when a request starts is rebuilt from zero features: it is not offered to the
    head's cache, so the next request on the prefix does not start on it (it rebuilds, or finds real pages)."""
    spec = SpecConfig(3, 1, 4)
    with engine(pair, spec=spec) as eng:
        drafter = eng.proposer
        eng.generate([SYSTEM + random_prompt(520, 6)], GREEDY)
        drafter.allocator.free(drafter.prefix_cache.evict(drafter.prefix_cache.num_evictable))  # evicted there
        rid = eng.add_request(SYSTEM + random_prompt(521, 6), GREEDY)
        eng.step()
        state = drafter.request_states([rid])[0]
        rebuilt = set(state.kv.pages[p] for p in state.zero_pages)
        assert len(rebuilt) == 20 // PAGE
        while eng.has_unfinished():
            eng.step()
        assert not any(drafter.prefix_cache.holds(p) for p in rebuilt)
        eng.generate([SYSTEM + random_prompt(522, 6)], GREEDY)
        assert drafter.prefix_cache.stats.hits == 0  # nothing poisoned was found


def _scored(eng: LLMEngine, prompt: list[int], params: SamplingParams):
    """Run ``prompt`` to its end → (its request, the prompt entries its first output carried)."""
    rid = eng.add_request(prompt, params)
    got = None
    while eng.has_unfinished():
        for out in eng.step():
            got = out.prompt_logprobs if out.prompt_logprobs is not None else got
    return eng.requests.pop(rid), got


def _assert_same_entries(got: list, want: list, note=None) -> None:
    assert len(got) == len(want), note
    for a, b in zip(got, want):
        assert abs(a.logprob - b.logprob) < 1e-5 and [i for i, _ in a.top] == [i for i, _ in b.top], note


def test_a_prompt_asking_for_prompt_logprobs_is_prefilled_whole(pair):
    """Its every position's logits are wanted, so it starts on no cached page: all its prompt entries come
    back, equal to the cache-off engine's; the next request on the same prefix still finds it cached."""
    first, second = SYSTEM + random_prompt(530, 5), SYSTEM + random_prompt(531, 7)
    asking = SamplingParams(max_new_tokens=3, ignore_eos=True, prompt_logprobs=2)

    def run(cache: bool):
        with engine(pair, 7, cache=cache) as eng:
            eng.generate([first], GREEDY)
            req, got = _scored(eng, second, asking)
            later = eng.add_request(second, GREEDY)
            while eng.has_unfinished():
                eng.step()
            return req, got, eng.requests.pop(later)

    (req, got, later), (ref_req, ref_got, ref_later) = run(True), run(False)
    assert req.cached_tokens == 0 and len(got) == len(second) - 1
    _assert_same_entries(got, ref_got)
    assert req.output == ref_req.output and later.output == ref_later.output
    assert later.cached_tokens == (len(second) - 1) // PAGE * PAGE


@pytest.mark.parametrize("chunk", [-1, 7])
def test_prompt_logprobs_from_a_position_start_on_the_cache_before_it(pair, chunk, monkeypatch):
    """SGLang's logprob_start_len: entries from token ``start`` on (scoring a continuation of a shared context). The
    context's pages before position ``start - 1`` come from the cache; the entries equal the same tokens' from a
    whole prefill with the cache off (all of them asked), and the output is the same."""
    first, second = SYSTEM + random_prompt(540, 5), SYSTEM + random_prompt(541, 9)
    start = len(SYSTEM) + 1
    tail = SamplingParams(max_new_tokens=3, ignore_eos=True, prompt_logprobs=2, prompt_logprobs_from=start)
    whole = SamplingParams(max_new_tokens=3, ignore_eos=True, prompt_logprobs=2)

    def run(cache: bool, params):
        with engine(pair, chunk, cache=cache) as eng:
            eng.generate([first], GREEDY)
            return _scored(eng, second, params)

    (req, got), (ref_req, ref_got) = run(True, tail), run(False, whole)
    assert req.cached_tokens == (start - 1) // PAGE * PAGE > 0
    assert len(got) == len(second) - start and len(ref_got) == len(second) - 1
    _assert_same_entries(got, ref_got[start - 1:])
    assert req.output == ref_req.output
    # scored cold (the cache off) the same, with logits only from position start - 1 on
    rows = []
    forward = SequenceChunk.__init__

    def noting(self, *args, **kwargs):
        forward(self, *args, **kwargs)
        if self.logits == "all" and self.tree_mask is None:
            rows.append(len(self.token_ids) - self.logits_from)

    monkeypatch.setattr(SequenceChunk, "__init__", noting)
    cold_req, cold = run(False, tail)
    assert cold_req.output == ref_req.output
    _assert_same_entries(cold, got)
    assert sum(rows) == len(second) - (start - 1)  # (positions start - 1 to the prompt's last)


def test_prompt_logprobs_from_every_position_across_chunk_boundaries(pair):
    """Chunks of 4 tokens, the cache off: from every start (a chunk wholly before it, one that straddles it, one whose
    last token's logits are its first entry) the entries are the whole prefill's from there on."""
    prompt = random_prompt(550, 14)
    whole = SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=1)

    def entries(params):
        with engine(pair, 4, cache=False) as eng:
            return _scored(eng, prompt, params)

    ref_req, ref = entries(whole)
    for start in range(2, len(prompt) + 1):
        req, got = entries(SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=1,
                                          prompt_logprobs_from=start))
        assert req.output == ref_req.output and len(got) == len(prompt) - start, start
        _assert_same_entries(got, ref[start - 1:], start)


class _Counting:
    """The in-process drafter with its calls counted by name."""

    def __init__(self, drafter, names=("attach_prefix", "extend", "release", "draft")):
        self.calls = dict.fromkeys(names, 0)
        for name in names:
            setattr(self, name, self._counted(name, getattr(drafter, name)))
        self._drafter = drafter

    def _counted(self, name, method):
        def call(*args, **kwargs):
            self.calls[name] += 1
            return method(*args, **kwargs)
        return call

    def __getattr__(self, name):
        return getattr(self._drafter, name)


def _policy_says(eng: LLMEngine, speculate) -> None:
    """The policy's decision for the batch at each step: ``speculate()``."""
    eng.policy.decide = lambda *args, **kwargs: speculate()
    eng.speculating = speculate()


def test_a_batch_that_decodes_plainly_costs_the_drafter_nothing(pair, reference):
    """With the cache on and speculation off for the batch, a request neither starts on the drafter nor
    catches it up when it finishes: no drafter call at all; every token the target's."""
    with engine(pair, spec=SpecConfig(3, 1, 4)) as eng:
        eng.proposer = counting = _Counting(eng.proposer)
        _policy_says(eng, lambda: False)
        outputs, reqs = conversation(eng)
        assert counting.calls == {"attach_prefix": 0, "extend": 0, "release": 0, "draft": 0}
        assert eng.drafts.held_bytes == 0 and all(r.attach_at is None and not r.pending_extend for r in reqs)
    assert outputs == reference


def test_speculation_resuming_makes_the_deferred_start_first_and_output_stays_exact(pair, reference):
    """Speculation off for the first steps, then on: requests that began while the batch decoded plainly
    start on the drafter's cached prefix at their first draft (the deferred attach, then their held
    features), speculate from then on, and every token is still the target's."""
    steps = []

    def speculate():
        steps.append(None)
        return len(steps) > 4

    with engine(pair, spec=SpecConfig(3, 2, 6)) as eng:
        eng.proposer = counting = _Counting(eng.proposer)
        _policy_says(eng, speculate)
        outputs, reqs = conversation(eng)
        assert counting.calls["attach_prefix"] > 0 and counting.calls["draft"] > 0
        assert eng.proposer.allocator.num_free == eng.proposer.allocator.capacity_pages
    assert outputs == reference
    assert reqs[0].spec_stats.rounds > 0  # began plainly, speculated once it was on


def test_a_cache_salt_shares_pages_only_with_its_own_salt(pair):
    """vLLM's cache_salt: a tenant's prompt finds none of another salt's (or the unsalted) pages — so it cannot time
    another's prompts through the cache — its own salt's, as an unsalted one finds the unsalted; outputs unchanged.
    With speculation: the head's cache is consulted only up to what the target found (DraftLink's attach)."""
    first, second = SYSTEM + random_prompt(520, 5), SYSTEM + random_prompt(521, 8)
    with engine(pair, cache=False) as eng:
        expected = eng.generate([second], GREEDY)[0].output_token_ids
    for spec in (None, SpecConfig(3, 1, 4)):
        with engine(pair, spec=spec) as eng:
            eng.add_request(first, GREEDY, cache_salt="tenant-a")
            while eng.has_unfinished():
                eng.step()
            found = {}
            for salt in ("", "tenant-b", "tenant-a"):
                rid = eng.add_request(second, GREEDY, cache_salt=salt)
                while eng.has_unfinished():
                    eng.step()
                req = eng.requests.pop(rid)
                found[salt] = req.cached_tokens
                assert req.output == expected, salt
            assert found == {"": 0, "tenant-b": 0, "tenant-a": 20}, found
            if spec is not None:  # the head found its pages of the shared prefix for tenant-a's request alone
                assert eng.proposer.prefix_cache.stats.hits == 20
