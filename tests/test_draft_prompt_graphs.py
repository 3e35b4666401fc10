"""The drafter's prompt-extend graphs (tandem.speculative.draft_prompt_graphs) on the CPU: their static path
(DraftGraphRunner without capture, widths from DrafterConfig's prefill-graph settings) leaves the draft KV,
roots, states and top-k that the eager extend leaves — new prompts of different lengths, a chunk going on
from a request's committed KV, a request started by attach_prefix — and then the same drafts; prompts wider
than the widest family, more requests than the largest bucket and batches past the padding bound stay eager.
End to end, a speculative engine on the graphs' static path (target and drafter) gives target-only greedy
output, with prompts arriving while others speculate on the prompt-extend family.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit

from draft_checkpoints import draft_inputs  # noqa: E402
from tandem.prefill_shapes import prefill_widths  # noqa: E402
from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter  # noqa: E402
from tandem.speculative.spec_config import SpecConfig

TOL = 1e-5
SPECS = (SpecConfig(3, 2, 6), SpecConfig(4, 1, 5))
INTERPRET = bool(os.environ.get("TRITON_INTERPRET"))


def drafters(pair, graphs: bool, tokens: int = 128, max_bs: int = 4, attention: str = "torch"):
    """A drafter (pages of 4, shuffled) whose prompt-extend widths and batches come from its config; with
    ``graphs`` its graphs' static path is set up the way capture_cuda_graphs sets it up."""
    cfg = DrafterConfig(page_size=4, kv_pages=512, page_shuffle_seed=3, prefill_graph_tokens=tokens,
                        prefill_graph_max_bs=max_bs)
    d = Eagle3Drafter.from_dirs(str(pair.draft_dir), str(pair.target_dir), cfg)
    if graphs:
        assert d.capture_cuda_graphs(list(SPECS), static=True, buckets=[1, 2, 4], attention=attention) is None
        prompts = d.graphs.prompts
        assert prompts.widths == prefill_widths(tokens) and prompts.max_bs == (max_bs if tokens else 0)
    return d


def items(seed: int, lengths: dict[str, int]):
    return [(rid, *draft_inputs(seed + i, n)) for i, (rid, n) in enumerate(lengths.items())]


def assert_same_drafters(got: Eagle3Drafter, want: Eagle3Drafter) -> None:
    """Same requests, committed lengths, roots, states, top-k, token records and committed draft KV."""
    assert set(got._reqs) == set(want._reqs)
    assert got.allocator.num_free == want.allocator.num_free
    kv_got = got.kv.data.view(2, -1, *got.kv.data.shape[-2:])  # [K/V, slots, Hkv, D]
    kv_want = want.kv.data.view(2, -1, *want.kv.data.shape[-2:])
    for rid, w in want._reqs.items():
        g = got._reqs[rid]
        assert (g.kv.num_tokens, g.root, g.tokens) == (w.kv.num_tokens, w.root, w.tokens), rid
        torch.testing.assert_close(g.state, w.state, atol=TOL, rtol=TOL)
        torch.testing.assert_close(g.top_logp, w.top_logp, atol=TOL, rtol=TOL)
        assert torch.equal(g.top_ids, w.top_ids), rid
        slots_g = torch.tensor([g.kv.slot(i) for i in range(g.kv.num_tokens)])
        slots_w = torch.tensor([w.kv.slot(i) for i in range(w.kv.num_tokens)])
        torch.testing.assert_close(kv_got[:, slots_g], kv_want[:, slots_w], atol=TOL, rtol=TOL)


def assert_same_drafts(got: Eagle3Drafter, want: Eagle3Drafter) -> None:
    rids = sorted(want._reqs)
    for spec in SPECS:
        for g, w in zip(got.draft(rids, spec), want.draft(rids, spec)):
            assert g.tokens == w.tokens and g.parents == w.parents
            assert g.scores == pytest.approx(w.scores, abs=TOL)


def test_prompt_extends_leave_the_eager_extends_state(pair):
    eager, static = drafters(pair, False), drafters(pair, True)
    runner = static.graphs
    calls = [  # (items, the prompt family's width that takes them, or None: eager)
        (items(1, {"a": 3, "b": 17, "c": 40}), 64),  # new prompts: bucket 4 (a padding row), width 64
        (items(2, {"d": 100, "e": 90}), 128),
        (items(3, {"a": 30}), 32),  # a chunk going on from a's 3 entries (wider than the draft-extend)
        (items(4, {"b": 2, "f": 11}), 16),  # a short extend of b beside a new prompt
        (items(5, {"g": 150}), None),  # wider than the widest family
        (items(6, {f"h{i}": 5 for i in range(5)}), None),  # 5 requests > --prefill-graph-max-bs 4
        (items(7, {"i": 3, "j": 17, "k": 40, "l": 100}), None),  # 4 x 128 padded rows > twice the 160 real
        (items(8, {"c": 3}), "extend"),  # an already-extended request's short extend: the draft-extend graph
    ]
    for batch, family in calls:
        before = dict(runner.replays)
        for d in (eager, static):
            d.extend(batch)
        prompt, extend = (runner.replays[k] - before[k] for k in ("draft_prompt", "draft_extend"))
        assert (prompt, extend) == ((1, 0) if isinstance(family, int) else (0, family == "extend")), batch
        assert_same_drafters(static, eager)
    static_graphs, static.graphs = static.graphs, None
    assert_same_drafts(static, eager)  # eagerly over the graph-built KV
    static.graphs = static_graphs
    assert_same_drafts(static, eager)  # and through the draft graphs


def test_a_request_started_by_attach_prefix_records_its_tokens(pair):
    """attach_prefix's request keeps its tokens for the prefix cache: the graph path extends them as the eager
    path does, and offers the cache the same full pages."""
    eager, static = drafters(pair, False), drafters(pair, True)
    tokens, feats = draft_inputs(20, 41)
    for d in (eager, static):
        assert d.attach_prefix("p", [7]) == 0
        d.extend([("p", tokens, feats)])
    assert static.graphs.replays["draft_prompt"] == 1
    assert_same_drafters(static, eager)
    for d in (eager, static):
        d.release("p")  # its full pages stay cached
    assert static.prefix_cache.num_evictable == eager.prefix_cache.num_evictable == 10


def test_off_and_return_logits_stay_eager(pair):
    static = drafters(pair, True, tokens=0)
    assert static.graphs.prompts.members == [] and [n for n, _ in static.graphs.capture_plan()] == ["draft",
                                                                                                     "draft_extend"]
    static.extend(items(30, {"a": 9}))
    static = drafters(pair, True)
    assert static.extend(items(31, {"a": 9}), return_logits=True) is not None
    assert static.graphs.replays["draft_prompt"] == 0 and static.has("a")


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")
def test_prompt_extend_with_the_triton_kernel(pair):
    eager, static = drafters(pair, False), drafters(pair, True, tokens=32, max_bs=2, attention="triton")
    for batch in (items(40, {"a": 5, "b": 20}), items(41, {"a": 12})):
        for d in (eager, static):
            d.extend(batch)
        assert_same_drafters(static, eager)
    assert static.graphs.replays["draft_prompt"] == 2


@pytest.mark.parametrize("prefix_caching", [True, False])  # requests start by attach_prefix, or by their extend
def test_speculative_engine_on_the_static_path_gives_target_only_greedy(pair, monkeypatch, prefix_caching):
    """Prompts arriving while others speculate (a step of prompts apart, chunked past 64 tokens): their extends
    go to the drafter's prompt-extend graphs, and the greedy output is the target's alone."""
    from helpers import TorchGraphBackend, generate_with_arrivals, target_only_greedy, torch_prompts
    from proposers import always_speculate
    from tandem.engine.config import EngineConfig
    from tandem.engine.speculative_setup import speculative_engine
    from tandem.sampling import SamplingParams

    prompts = torch_prompts(12, (5, 12, 3, 40, 100, 150))
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    reference = target_only_greedy(pair.target_dir, prompts, 10, page_size=4)
    # torch attention in the target's graphs (the Triton kernels' static path is test_graph_static_path's)
    monkeypatch.setattr("tandem.attention.graph_backend.make_graph_backend", lambda latent=False: TorchGraphBackend())
    cfg = EngineConfig(model=str(pair.target_dir), page_size=4, static_graph_path=True, cuda_graph_max_bs=4,
                       prefill_graph_tokens=64, prefill_graph_max_bs=4, chunked_prefill_size=64,
                       enable_prefix_caching=prefix_caching)
    with speculative_engine(cfg, str(pair.draft_dir), SpecConfig(3, 1, 4), policy=always_speculate()) as eng:
        assert eng.prefill_apart and eng.proposer.graphs.prompts.widths == (16, 32, 64)
        rids, outputs = generate_with_arrivals(eng, prompts, params)  # arrivals while the first ones speculate
        replays = dict(eng.proposer.graphs.replays)
        rounds = sum(eng.requests[r].spec_stats.rounds for r in rids)
    assert outputs == reference
    assert replays["draft_prompt"] >= 3 and rounds > 0, replays
