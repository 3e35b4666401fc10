"""Greedy chain rounds queued on the device (--spec-rounds; tandem.speculative.chain_rounds) emit
target-only greedy decoding's tokens, accept what one round per step accepts, stop where a stop token
says and give every page back — with the graphs' replays stood in by their static code run eagerly
(the target's under Triton's interpreter, the drafter's static path), so the device-side acceptance,
input advancing and extend feeding are what is tested here; capture itself is tested on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling import SamplingParams
from tandem.speculative.chain_depth import chain_ladder
from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
from tandem.speculative.spec_config import SpecConfig
from proposers import CyclingChains, always_speculate

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="runs the Triton kernels: set TRITON_INTERPRET=1 on a CPU machine")

SPEC = SpecConfig(3, 1, 4)
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from draft_checkpoints import write_pair
    from helpers import target_only_greedy, torch_prompts

    # Not conftest's shared pair: its target repeats one token for most of a continuation (2-3 distinct
    # in 20 tokens), under which acceptance hardly tells right from wrong; this target (test_spec_eagle3's)
    # gives 6-9 distinct tokens in 20 on two of the three prompts.
    root = tmp_path_factory.mktemp("chainrounds")
    write_pair(root, target_seed=13, draft_seed=5)
    prompts = torch_prompts(2, (3, 9, 17))
    return root, prompts, target_only_greedy(root / "target", prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def one_round_steered(pair):
    """One round per step, steered at corruption 0.3 (rounds accept 0..3 drafts): (outputs, accepted
    drafts per round) — what queued runs must reproduce, with either glue between the graphs."""
    _, prompts, ref = pair
    with _speculative_engine(pair[0]) as eng:
        outputs, accepted, most = _run(eng, prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), 1,
                                       ref, rate=0.3)
        assert most == 1 and _all_pages_free(eng)
    return outputs, accepted


@pytest.fixture
def engine(pair):
    with _speculative_engine(pair[0]) as eng:
        yield eng


def _speculative_engine(root, prefix_caching: bool = True, policy=None, draft_prompts: tuple[int, int] = (0, 1)) -> LLMEngine:
    """An in-process speculative engine whose target and drafter graphs run their static code eagerly,
    with torch attention on both sides (the round glue and the chain's pick stay Triton kernels,
    interpreted, where a test forces the fused path). ``draft_prompts``: the drafter's prompt-extend
    family (width, requests) as served, none by default."""
    from helpers import TorchGraphBackend, static_target_graphs
    from tandem.configs.model import ModelConfig
    from tandem.configs.eagle3 import DraftConfig, validate_draft
    from tandem.speculative.draft_graph import DraftGraphRunner

    capture = validate_draft(DraftConfig.from_dir(root / "draft"), ModelConfig.from_dir(root / "target"))
    cfg = EngineConfig(model=str(root / "target"), page_size=4, page_shuffle_seed=3, capture_layers=capture,
                       enable_prefix_caching=prefix_caching)
    chains = chain_ladder(SPEC)  # graphs for every chain a policy may shorten to
    eng = LLMEngine(cfg, spec=SPEC, policy=policy or always_speculate())
    runner = eng.executor.runner
    drafter = Eagle3Drafter.from_dirs(str(root / "draft"), str(root / "target"),
                                      DrafterConfig(page_size=4, defer_chain_tokens=True, page_shuffle_seed=5),
                                      capture_layers=capture, embed_weight=runner.model.model.embed_tokens.weight)
    width, requests = draft_prompts
    drafter.graphs = DraftGraphRunner(drafter, list(chains), buckets=[1, 2, 4], use_graphs=False, attention="torch",
                                      prompt_widths=(width,) if width else (), prompt_max_bs=requests)
    eng.proposer, eng.default_spec = drafter, SPEC
    runner.graph_backend = TorchGraphBackend()  # the target's attention in torch: these tests are about the rounds
    runner.graphs = static_target_graphs(runner, widths=(1, *(c.num_draft_tokens for c in chains)), max_bs=4)
    return eng


def _run(eng, prompts, params, spec_rounds, refs=None, rate=None):
    """Generate with ``spec_rounds`` (steered by the controlled-acceptance instrument at ``rate`` toward
    ``refs`` when given) → (outputs, per-request accepted drafts per round, largest run of rounds)."""
    import tandem.engine.rounds_ahead as rounds_ahead
    from tandem.speculative.controlled import ControlledAcceptanceProposer

    drafter = eng.proposer
    if rate is not None:
        eng.proposer = ControlledAcceptanceProposer(drafter, rate, seed=7)
    eng.spec_rounds = spec_rounds
    runs, real = [], rounds_ahead.queue_chain_rounds

    def counting(graphs, drafter, reqs, spec, rounds, *rest):
        runs.append(rounds)
        return real(graphs, drafter, reqs, spec, rounds, *rest)

    rounds_ahead.queue_chain_rounds = counting
    try:
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        rids = [eng.add_request(p, sp, rid=f"p{i}") for i, (p, sp) in enumerate(zip(prompts, per_prompt))]
        if rate is not None:
            for rid, prompt, ref in zip(rids, prompts, refs):
                eng.proposer.set_reference(rid, len(prompt), ref + [0] * 8)
        streamed = {rid: [] for rid in rids}  # accepted drafts per round, as each step reports them
        while eng.has_unfinished():
            for out in eng.step():
                streamed[out.rid] += out.round_accepts
        results = [eng.requests.pop(rid) for rid in rids]
    finally:
        rounds_ahead.queue_chain_rounds = real
        eng.proposer = drafter
    assert [streamed[rid] for rid in rids] == [r.spec_stats.accepted_per_round for r in results]
    return [r.output for r in results], [r.spec_stats.accepted_per_round for r in results], max(runs, default=1)


def _all_pages_free(eng):
    drafter = eng.proposer.rounds_drafter
    return (eng.allocator.num_free == eng.allocator.capacity_pages
            and drafter.allocator.num_free == drafter.allocator.capacity_pages)


def test_queued_chain_rounds_emit_target_greedy_and_accept_as_one_round_steps(engine, pair, one_round_steered):
    """Steered by the controlled-acceptance instrument (corruption 0.3: rounds accept 0..3 drafts), so
    the device's acceptance has something to decide; then the random head on its own."""
    _, prompts, ref = pair
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    one_round, accepted_one = one_round_steered
    queued, accepted_queued, most = _run(engine, prompts, params, 4, ref, rate=0.3)
    assert one_round == ref and queued == ref  # both equal target-only greedy decoding
    assert most > 1  # the queued run really queued rounds
    # The same drafts and the same verify per round: the device's acceptance takes what the host's did.
    assert accepted_queued == accepted_one
    assert {a for per_request in accepted_queued for a in per_request} == {0, 1, 2, 3}
    assert _all_pages_free(engine)
    unsteered, _, most = _run(engine, prompts, params, 4)
    assert unsteered == ref and most > 1
    assert _all_pages_free(engine)


def _head_kv(drafter, rid: str, upto: int) -> torch.Tensor:
    """The head's committed KV of ``rid``'s first ``upto`` entries: [entries, upto, heads, dim]."""
    state = drafter.request_states([rid])[0]
    slots = torch.tensor([state.kv.slot(t) for t in range(upto)])
    return drafter.kv.data.flatten(2, 3)[:, 0].index_select(1, slots)


def test_the_heads_pages_that_runs_fill_are_cached_as_a_whole_prefill_builds_them(pair):
    """A second turn (the prompt, its answer from queued runs, more tokens) starts on the head's pages
    filled by the runs: the head's KV there is the one a whole-prompt prefill builds with the cache off."""
    _, prompts, ref = pair
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    turn = prompts[2] + ref[2] + [5, 6, 7]
    with _speculative_engine(pair[0]) as eng:
        _, _, most = _run(eng, prompts[2:], params, 4)
        assert most > 1
        rid = eng.add_request(turn, params, rid="turn")
        eng.step()
        cached = eng.requests[rid].cached_tokens
        state = eng.proposer.request_states([rid])[0]
        assert cached == (len(prompts[2]) + NEW_TOKENS - 1) // 4 * 4 and not state.zero_pages
        assert eng.proposer.prefix_cache.stats.hits == cached
        got = _head_kv(eng.proposer, rid, cached)
    with _speculative_engine(pair[0], prefix_caching=False) as eng:
        rid = eng.add_request(turn, params, rid="turn")
        eng.step()
        expected = _head_kv(eng.proposer, rid, cached)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_a_stop_token_inside_a_run_ends_the_request_there(engine, pair):
    """Every draft accepted (corruption 0: 4 tokens a round after the prefill's one); the stop token is
    the 15th output token, the second of the fourth round (or an earlier output, where it came first)."""
    _, prompts, ref = pair
    stop = ref[1][14]
    cut = ref[1].index(stop) + 1
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=[stop])
    outputs, accepted, most = _run(engine, prompts[1:2], params, 8, ref[1:2], rate=0.0)
    assert most > 1 and set(accepted[0]) == {3}
    assert outputs == [ref[1][:cut]]
    assert _all_pages_free(engine)


def test_a_request_near_its_end_does_not_cut_a_batchs_runs_to_single_rounds(engine, pair, monkeypatch):
    """Four requests, one of them wanting 2 tokens (its end one round away after the prefill's token): the batch's
    first run is still two rounds (the round after its end is an eighth of the run's request-rounds); each
    request's tokens are target-only greedy's, cut at its own length, and every page comes back."""
    import tandem.engine.rounds_ahead as rounds_ahead
    from tandem.engine.rounds_ahead import _useful_run

    _, prompts, ref = pair
    batch, refs = prompts + prompts[:1], ref + ref[:1]
    lengths = [2, NEW_TOKENS, NEW_TOKENS, NEW_TOKENS]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    runs, real = [], rounds_ahead.queue_chain_rounds

    def recording(graphs, drafter, reqs, spec, rounds, *rest):
        runs.append((len(reqs), rounds))
        return real(graphs, drafter, reqs, spec, rounds, *rest)

    monkeypatch.setattr(rounds_ahead, "queue_chain_rounds", recording)
    outputs, _, _ = _run(engine, batch, params, 4, refs, rate=0.0)
    assert outputs == [r[:n] for r, n in zip(refs, lengths)]
    assert runs[0] == (4, 2)
    assert _all_pages_free(engine)
    # the rule: alone, a run stops at the request's end; in a batch of 64, one request near its end does not
    # shorten it, half the batch does
    assert (_useful_run(4, [2]), _useful_run(4, [0])) == (2, 0)
    assert _useful_run(4, [1] + [30] * 63) == 4
    assert _useful_run(4, [1] * 32 + [30] * 32) == 1


def test_runs_fall_back_to_one_round_where_the_device_cannot_decide(engine, pair):
    """A sampled request (rejection sampling stays on the host) makes every step one round; the
    tokens still follow the engine's one-round path (seeded: the same with and without --spec-rounds)."""
    _, prompts, _ = pair
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=11, max_new_tokens=12, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    one_round, _, _ = _run(engine, prompts[:2], [greedy, sampled], 1)
    mixed, _, most = _run(engine, prompts[:2], [greedy, sampled], 4)
    assert most == 1 and mixed == one_round
    assert _all_pages_free(engine)


def test_runs_leave_the_drafter_where_one_round_steps_leave_it(pair, monkeypatch):
    """The drafter's side of two runs — the second queued after the first from the device's state
    (overlapped runs) — its extends fed from the device, its lengths and roots advanced there, ends
    in the state that one round per step reaches after the same tokens: committed length, root, state,
    top-k and every committed K/V entry, and the target's committed K/V entries too (the steered tokens
    hide the head's own drafts from the acceptance, and a random model's greedy tokens shrug off a few
    wrong keys, so the output alone would not show a wrong state). Both glues between the graphs: torch
    ops, and the GPU's fused kernels (forced under the interpreter)."""
    import tandem.speculative.chain_rounds as chain_rounds
    from tandem.speculative.controlled import ControlledAcceptanceProposer

    root, prompts, ref = pair
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)  # two runs of 4 rounds: up to 32 tokens
    states, target = {}, None
    for name, spec_rounds in (("torch glue", 4), ("fused glue", 4), ("one round per step", 1)):
        monkeypatch.setattr(chain_rounds, "use_triton", lambda x, fused=name == "fused glue": fused)
        with _speculative_engine(root) as eng:
            drafter = eng.proposer
            eng.proposer, eng.spec_rounds = ControlledAcceptanceProposer(drafter, 0.3, seed=7), spec_rounds
            rids = [eng.add_request(p, params, rid=f"p{i}") for i, p in enumerate(prompts)]
            for rid, prompt, r in zip(rids, prompts, ref):
                eng.proposer.set_reference(rid, len(prompt), r + [0] * 64)
            eng.step()  # the prefill
            if spec_rounds > 1:
                eng.step()  # one run of rounds read back, the next queued after it
                eng.step()  # that one read back
                reached = {rid: eng.requests[rid].num_tokens for rid in rids}
                assert target is None or reached == target  # both glues accept alike
                target = reached
            else:  # one round at a time, up to the runs' tokens (the same acceptance: the tests above)
                while any(eng.requests[rid].num_tokens < target[rid] for rid in rids):
                    eng.step()
                assert {rid: eng.requests[rid].num_tokens for rid in rids} == target
            per_request = []
            for rid, s in zip(rids, drafter.request_states(rids)):
                req = eng.requests[rid]
                kv = _entries(drafter.kv.data, s.kv, s.kv.num_tokens)
                target_kv = _entries(eng.executor.runner.kv.data, req.kv, req.kv.num_tokens)
                per_request.append((s.kv.num_tokens, s.root, s.state, s.top_logp, s.top_ids.tolist(), kv, target_kv))
            states[name] = per_request
            assert max(len(o) for o in (eng.requests[rid].output for rid in rids)) > 4  # more than one round's worth
    for glue in ("torch glue", "fused glue"):
        for (n, root_token, state, logp, ids, kv, tkv), (n1, root1, state1, logp1, ids1, kv1, tkv1) in zip(
                states[glue], states["one round per step"]):
            assert (n, root_token, ids) == (n1, root1, ids1), glue
            torch.testing.assert_close(state, state1)
            torch.testing.assert_close(logp, logp1)
            torch.testing.assert_close(kv, kv1)
            torch.testing.assert_close(tkv, tkv1)


def _entries(pool, kv, count):
    """A pool's K/V entries [2, layers, count, heads, dim] of a sequence's first ``count`` tokens."""
    return pool.view(2, pool.shape[1], -1, *pool.shape[-2:])[:, :, [kv.slot(i) for i in range(count)]]


def test_the_verifiers_guarded_head_runs_rounds_and_survives_their_failure(engine, pair, monkeypatch):
    """``--drafter in-process`` wraps the head (verifier/in_process_head.py): its chain rounds queue on
    the device too, and a recoverable failure inside a run costs the requests their speculation (they
    decode on plainly, to the same tokens), not the verifier."""
    from verifier.in_process_head import GuardedHead

    _, prompts, ref = pair
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = [r[:12] for r in ref]
    drafter = engine.proposer
    engine.proposer = GuardedHead(drafter)
    outputs, _, most = _run(engine, prompts[:2], params, 4)
    assert outputs == ref[:2] and most > 1
    assert _all_pages_free(engine)

    def broken(reqs):
        raise KeyError("the head lost a request")

    monkeypatch.setattr(drafter.graphs, "begin_rounds", broken)
    outputs, accepted, most = _run(engine, prompts[:2], params, 4)
    assert outputs == ref[:2] and most > 1  # a run was tried, failed, and decoding went on
    assert all(len(a) <= 1 for a in accepted)  # no speculation after the failure (the prefill's round at most)
    assert _all_pages_free(engine)


def test_a_draft_that_comes_back_nan_inside_a_run_costs_speculation_not_tokens(engine, pair):
    """A NaN in the head shows in a run's draft only on the device: from that round on the request
    takes the root's token per round (a plain step's), those rounds do not count as speculative ones,
    and after the run it decodes on without speculation, as one round per step handles a broken draft."""
    _, prompts, ref = pair
    engine.spec_rounds = 4
    rid = engine.add_request(prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # a run of rounds read back, the next one queued (from a sound head)
    rounds_before = engine.requests[rid].spec_stats.rounds
    assert rounds_before > 1 and engine.run_in_flight is not None
    # The head breaks: its extends' states, and so the chains drafted from them, come out NaN.
    engine.proposer.head.fc.weight.data.fill_(float("nan"))
    req = engine.requests[rid]
    while req.draft_ready:
        engine.step()
    rounds_at_break = req.spec_stats.rounds
    # At most the run queued before the head broke, and the first round of the run after it (drafted
    # from that run's last sound extend), count.
    assert rounds_before < rounds_at_break <= rounds_before + engine.spec_rounds + 1
    while engine.has_unfinished():
        engine.step()
    req = engine.requests.pop(rid)
    assert req.output == ref[0] and req.spec_stats.rounds == rounds_at_break
    assert _all_pages_free(engine)


def test_runs_near_the_end_of_the_context_stay_inside_it(engine, pair):
    """A prompt 22 tokens short of the 512-token context: runs are cut so that every verify's positions
    stay inside it, the last tokens come from plain steps, and the output is target-only's to the end."""
    root = pair[0]
    prompt = torch.randint(3, 256, (490,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(root / "target"))) as plain:
        ref = plain.generate([prompt], params)[0].output_token_ids
    assert len(ref) == 512 - 490  # the context ends it
    outputs, accepted, most = _run(engine, [prompt], params, 8, [ref], rate=0.0)
    assert outputs == [ref] and 1 < most < 8 and set(accepted[0]) == {3}
    assert _all_pages_free(engine)


def test_a_run_the_drafters_pages_cannot_hold_is_shortened(engine, pair):
    """With the drafter's KV cache nearly full a run of four rounds does not fit but a shorter one does:
    the step queues the shorter run rather than falling back to one round."""
    from tandem.speculative.chain_rounds import chain_rounds_fit

    _, prompts, ref = pair
    drafter, graphs = engine.proposer, engine.executor.runner.graphs
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    rid = engine.add_request(prompts[2], params, rid="full")
    engine.step()  # the prefill (and the drafter's first extend)
    held = []
    while chain_rounds_fit(drafter, graphs, [rid], SPEC, 4):
        held += drafter.allocator.allocate(1)  # someone else's pages
    assert chain_rounds_fit(drafter, graphs, [rid], SPEC, 2)
    _a_shorter_run_then_the_rest(engine, rid, ref[2], lambda: drafter.allocator.free(held))


def _a_shorter_run_then_the_rest(engine, rid: str, expected: list[int], free_held) -> None:
    """The next step (up to 4 rounds allowed) queues a run of 2 or 3 rounds; then the held pages go back
    (``free_held``), the request decodes to its end as target-only does, and every page is free."""
    import tandem.engine.rounds_ahead as rounds_ahead

    runs, real = [], rounds_ahead.queue_chain_rounds
    rounds_ahead.queue_chain_rounds = lambda *a: runs.append(a[4]) or real(*a)
    try:
        engine.spec_rounds = 4
        engine.step()
    finally:
        rounds_ahead.queue_chain_rounds = real
    assert runs and 1 < runs[0] < 4
    free_held()
    while engine.has_unfinished():
        engine.step()
    assert engine.requests.pop(rid).output == expected
    assert _all_pages_free(engine)


def test_a_run_the_targets_free_pages_cannot_hold_is_shortened(engine, pair):
    """With the target's KV cache nearly full, four rounds' worst case (every draft accepted) does not fit but two
    rounds' does: the step queues the shorter run rather than falling back to one round; tokens as target-only's."""
    _, prompts, ref = pair
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    rid = engine.add_request(prompts[2], params, rid="full")
    engine.step()  # the prefill
    req, nd = engine.requests[rid], SPEC.num_draft_tokens

    def need(rounds):
        return req.kv.pages_needed(req.num_tokens - 1 + rounds * nd)

    assert need(2) < need(4)
    held = engine.allocator.allocate(engine.allocator.num_free - need(2))  # someone else's pages
    _a_shorter_run_then_the_rest(engine, rid, ref[2], lambda: engine.allocator.free(held))


def test_the_fused_round_glue_runs_rounds_as_one_round_steps(engine, pair, one_round_steered, monkeypatch):
    """On the GPU the glue between a round's graphs is three kernels (tandem/kernels/round_glue.py):
    forced here under the interpreter, steered runs of rounds (overlapped, so a run goes on from the
    glue's device state) give target-only greedy tokens and one round per step's acceptance per round
    (the drafter's state they leave: test_runs_leave_the_drafter_where_one_round_steps_leave_it)."""
    import tandem.speculative.chain_rounds as chain_rounds

    _, prompts, ref = pair
    monkeypatch.setattr(chain_rounds, "use_triton", lambda x: True)
    fused, accepted_fused, most = _run(engine, prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), 4,
                                       ref, rate=0.3)
    assert fused == ref and most > 1
    assert accepted_fused == one_round_steered[1]
    assert _all_pages_free(engine)


@pytest.mark.parametrize("glue", ["torch", "fused"])
def test_queued_rounds_record_logprobs_equal_to_transformers(engine, pair, monkeypatch, glue):
    """Requests asking for logprobs stay in runs: each round's verify records the raw log-softmax at the
    nodes the round emits from, equal to transformers' on the same weights; the request that does not
    ask gets none. Steered (corruption 0.3), so rounds accept different numbers of drafts."""
    import tandem.speculative.chain_rounds as chain_rounds
    from transformers import AutoModelForCausalLM

    from tandem.speculative.controlled import ControlledAcceptanceProposer

    root, prompts, ref = pair
    if glue == "fused":
        monkeypatch.setattr(chain_rounds, "use_triton", lambda x: True)
    drafter = engine.proposer
    engine.proposer, engine.spec_rounds = ControlledAcceptanceProposer(drafter, 0.3, seed=7), 4
    try:
        rids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                     logprobs=3 if i else None), rid=f"p{i}")
                for i, p in enumerate(prompts)]
        for rid, prompt, r in zip(rids, prompts, ref):
            engine.proposer.set_reference(rid, len(prompt), r + [0] * 8)
        tokens, logprobs, most = {r: [] for r in rids}, {r: [] for r in rids}, 1
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.rid] += out.new_token_ids
                logprobs[out.rid] += out.logprobs or []
            most = max(most, engine.last_step.steps if engine.last_step else 1)
        for rid in rids:
            engine.requests.pop(rid)
    finally:
        engine.proposer = drafter
    assert [tokens[r] for r in rids] == ref and most > 1
    assert logprobs["p0"] == []
    hf = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()
    for rid, prompt in zip(rids[1:], prompts[1:]):
        with torch.no_grad():
            want = hf(torch.tensor([prompt + tokens[rid]])).logits[0].log_softmax(-1)
        assert len(logprobs[rid]) == NEW_TOKENS
        for j, (token, entry) in enumerate(zip(tokens[rid], logprobs[rid])):
            row = want[len(prompt) - 1 + j]
            assert abs(entry.logprob - row[token].item()) <= 1e-3
            assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
            assert max(abs(v - w) for (_, v), w in zip(entry.top, row.topk(3).values.tolist())) <= 1e-3
    assert _all_pages_free(engine)


def test_a_shorter_chain_takes_over_between_runs_and_tokens_stay_target_greedy(pair):
    """With runs of rounds queued back to back, a chain the policy picks anew takes over once the run in flight is
    read back (no further run of the old chain is queued behind it): every chain runs, in runs, and the output is
    target-only greedy."""
    import tandem.engine.rounds_ahead as rounds_ahead
    from helpers import target_only_greedy

    root, prompts, _ = pair
    ref = target_only_greedy(root / "target", prompts, 48)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)

    widths, real = [], rounds_ahead.queue_chain_rounds

    def recording(graphs, side, reqs, spec, rounds, *rest):
        widths.append((spec.num_draft_tokens, rounds))
        return real(graphs, side, reqs, spec, rounds, *rest)

    with _speculative_engine(pair[0], policy=CyclingChains()) as eng:
        rounds_ahead.queue_chain_rounds = recording
        try:
            outputs, _, most = _run(eng, prompts, params, 4, ref, rate=0.3)
        finally:
            rounds_ahead.queue_chain_rounds = real
        assert outputs == ref and most > 1
        assert {w for w, _ in widths} == {2, 3, 4} and any(r > 1 for w, r in widths if w < 4)
        assert _all_pages_free(eng)


def test_a_policy_learning_the_traffic_queues_no_more_rounds_than_it_has_left_to_learn(pair):
    """While the default policy has yet to hear ``warmup_rounds`` rounds of new traffic it speculates to learn τ, in
    runs no longer than the rounds it has left to learn spread over the batch (what those rounds teach decides
    whether queuing runs pays: a head that accepts nothing paid the runs queued meanwhile). Then full runs; the
    output stays target-only greedy."""
    from helpers import target_only_greedy
    from tandem.speculative.policy import PolicyConfig, SpeculationPolicy

    class Speculating(SpeculationPolicy):  # the default policy's learning, every step speculative
        def decide(self, batch_size, drafting, runs=None):
            return bool(drafting)

    root, prompts, _ = pair
    ref = target_only_greedy(root / "target", prompts, 24)
    policy = Speculating(PolicyConfig(warmup_rounds=12))
    with _speculative_engine(root, policy=policy) as eng:
        eng.spec_rounds = 4
        rids = [eng.add_request(p, SamplingParams(max_new_tokens=24, ignore_eos=True)) for p in prompts]
        steps = []  # (rounds heard before the step, rounds the step ran) of speculative decode steps
        while eng.has_unfinished():
            heard = policy.rounds_all
            eng.step()
            info = eng.last_step
            if info is not None and info.speculative and info.num_decode:
                steps.append((heard, info.steps))
        assert [eng.requests.pop(rid).output for rid in rids] == ref
    learning = [(heard, run) for heard, run in steps if heard < 12]
    batch = len(prompts)
    assert all(run <= -(-(12 - heard) // batch) for heard, run in learning), steps
    assert any(run > 1 for _, run in learning), steps  # (runs, not lone rounds, where the batch leaves some to learn)
    assert max(run for heard, run in steps if heard >= 12) == 4, steps


def test_a_round_time_is_never_taken_from_the_steps_around_a_change_of_depth(pair):
    """A depth the policy runs only now and then would otherwise be timed by the steps that pay for the change (the
    old runs ended, the new one queued with nothing to overlap): with the chain changing at every decision no
    speculative step is timed, nor counted in goodput; with one chain throughout, the runs are."""
    from helpers import target_only_greedy

    root, prompts, _ = pair
    ref = target_only_greedy(root / "target", prompts, 24)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for policy, cycling in ((CyclingChains(), True), (always_speculate(), False)):
        timed, goodput = [], []
        observe, observe_goodput = policy.observe_step, policy.observe_goodput

        def recording(batch_size, speculative, steps=1, seconds=None, *args, **kwargs):
            if speculative and steps > 1:
                timed.append(seconds is not None)
            return observe(batch_size, speculative, steps, seconds, *args, **kwargs)

        def recording_goodput(batch_size, speculative, *args, **kwargs):
            goodput.append(speculative)
            return observe_goodput(batch_size, speculative, *args, **kwargs)
        policy.observe_step, policy.observe_goodput = recording, recording_goodput
        with _speculative_engine(root, policy=policy) as eng:
            outputs, _, most = _run(eng, prompts, params, 4, ref, rate=0.3)
        assert outputs == ref and most > 1 and timed
        assert not any(timed) if cycling else any(timed), (cycling, timed)
        assert not any(goodput) if cycling else any(goodput), (cycling, goodput)
