"""The drafter's CUDA-graph path on CPU: the static-shape code the graphs capture (draft_static.py, run
by DraftGraphRunner with use_graphs=False) computes what the eager Eagle3Drafter computes.

- draft: for topk 1–4, steps 1–6, num_draft_tokens up to 16, batches of 1–5 requests padded to larger
  buckets, pages scattered: same trees (tokens, parents; scores within 1e-5), committed state untouched,
  padding rows write only into the dummy page 0.
- draft-extend: after static extends of random widths (≤ num_steps + 1) the drafter holds the same
  lengths, roots, states and top-k as an eager twin, and drafts identical trees.
- routing through Eagle3Drafter.extend/draft, and the eager fallbacks (prefill, wide extends, too many
  requests, an uncaptured SpecConfig, return_logits).

The attention is the static torch version of the kernel for the sweep, and the Triton kernel itself
(under TRITON_INTERPRET=1 on a CPU machine, slow) for a few cases.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit

from draft_checkpoints import draft_inputs, pair_drafter  # noqa: E402
from tandem.errors import ConfigError  # noqa: E402
from tandem.speculative.draft_graph import DraftGraphRunner  # noqa: E402
from tandem.speculative.spec_config import SpecConfig  # noqa: E402

TOL = 1e-5
BUCKETS = [2, 4, 8]  # batches of 1, 3 and 5 requests carry padding rows
LENGTHS = {"a": 3, "b": 6, "c": 9, "d": 14, "e": 21}  # cross page boundaries (page size 4)
INTERPRET = bool(os.environ.get("TRITON_INTERPRET"))
NEEDS_INTERPRET = pytest.mark.skipif(not INTERPRET, reason="the Triton kernel on CPU needs TRITON_INTERPRET=1")


def prefill(drafter, lengths=LENGTHS, seed=0):
    drafter.extend([(rid, *draft_inputs(seed + i, n)) for i, (rid, n) in enumerate(lengths.items())])


@pytest.fixture(scope="module")
def extended(pair):
    drafter = pair_drafter(pair)
    prefill(drafter)
    return drafter


def assert_same_trees(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens and g.parents == w.parents
        assert g.scores == pytest.approx(w.scores, abs=TOL)


def state_of(drafter):
    return {rid: (r.kv.num_tokens, r.root, r.state, r.top_logp, r.top_ids) for rid, r in drafter._reqs.items()}


def sweep_specs():
    rng = random.Random(0)
    for steps in range(1, 7):
        for topk in range(1, 5):
            most = min(16, 1 + SpecConfig(steps, topk, 2).num_candidates)
            yield steps, topk, sorted({most, rng.randint(2, most)})


@pytest.mark.parametrize("steps,topk,sizes", list(sweep_specs()), ids=lambda v: str(v))
def test_static_draft_equals_eager(extended, steps, topk, sizes):
    specs = [SpecConfig(steps, topk, n) for n in sizes]
    runner = DraftGraphRunner(extended, specs, buckets=BUCKETS, use_graphs=False, attention="torch")
    rids = list(LENGTHS)
    free, before = extended.allocator.num_free, {r: extended.num_tokens(r) for r in rids}
    for spec in specs:
        for batch in (rids[:1], rids[2:4], rids[::-1][:3], rids[1:5], rids):
            reqs = [extended._reqs[r] for r in batch]
            assert_same_trees(runner.draft(reqs, spec), extended.draft(batch, spec))
    assert runner.replays["draft"] == 5 * len(specs)
    assert extended.allocator.num_free == free and {r: extended.num_tokens(r) for r in rids} == before


@NEEDS_INTERPRET
@pytest.mark.parametrize("spec,batch", [(SpecConfig(6, 4, 16), "bde"), (SpecConfig(3, 2, 6), "c"),
                                        (SpecConfig(4, 1, 5), "ae")])
def test_static_draft_with_triton_kernel_equals_eager(extended, spec, batch):
    runner = DraftGraphRunner(extended, [spec], buckets=[4], use_graphs=False, attention="triton")
    assert_same_trees(runner.draft([extended._reqs[r] for r in batch], spec), extended.draft(list(batch), spec))


@NEEDS_INTERPRET
@pytest.mark.parametrize("spec,batch", [(SpecConfig(4, 1, 5), "ae"), (SpecConfig(6, 1, 7), "bcd")])
def test_static_chain_with_the_fused_pick_equals_eager(extended, spec, batch, monkeypatch):
    """On the GPU a chain's per-step choice (log-softmax, top 1, draft→target ids, score) is one kernel
    (tandem/kernels/chain_pick.py); forced here on the CPU (Triton's interpreter) it drafts the eager
    drafter's chains."""
    import tandem.speculative.draft_static as draft_static

    monkeypatch.setattr(draft_static, "use_triton", lambda x: True)
    runner = DraftGraphRunner(extended, [spec], buckets=[4], use_graphs=False, attention="triton")
    assert_same_trees(runner.draft([extended._reqs[r] for r in batch], spec), extended.draft(list(batch), spec))


def test_padding_rows_touch_only_the_dummy_page(pair):
    drafter = pair_drafter(pair)
    prefill(drafter)
    spec = SpecConfig(5, 3, 12)
    runner = DraftGraphRunner(drafter, [spec], buckets=[8], use_graphs=False, attention="torch")
    flat = drafter.kv.data.view(2, -1, *drafter.kv.data.shape[-2:])  # [2, slots, Hkv, D]
    before = flat.clone()
    batch = ["b", "d", "e"]  # 5 padding rows
    runner.draft([drafter._reqs[r] for r in batch], spec)
    changed = (flat != before).flatten(2).any(2).any(0).nonzero().flatten().tolist()
    ps = drafter.cfg.page_size
    committed = {r.kv.slot(i) for r in drafter._reqs.values() for i in range(r.kv.num_tokens)}
    outside = [s for s in changed if s // ps != 0]
    assert any(s // ps == 0 for s in changed), "padding rows should write into the dummy page"
    assert not committed & set(changed), "committed KV was overwritten"
    assert len(outside) <= len(batch) * (spec.num_steps - 1) * spec.topk  # only the real rows' scratch


def extend_rounds(seed: int, rids: list[str], width: int, rounds: int):
    """Random rounds: a subset of 1–5 requests, each extended by 1..width tokens."""
    rng = random.Random(seed)
    for r in range(rounds):
        batch = rng.sample(rids, rng.randint(1, len(rids)))
        yield [(rid, *draft_inputs(1000 * seed + 10 * r + i, rng.randint(1, width))) for i, rid in enumerate(batch)]


@pytest.mark.parametrize("attention", ["torch", pytest.param("triton", marks=NEEDS_INTERPRET)])
def test_static_extend_leaves_the_same_state(pair, attention):
    eager, static = pair_drafter(pair), pair_drafter(pair)
    specs = [SpecConfig(5, 2, 8), SpecConfig(3, 4, 10)]
    static.graphs = runner = DraftGraphRunner(static, specs, buckets=BUCKETS, use_graphs=False, attention=attention)
    for d in (eager, static):
        prefill(d)
    assert runner.replays["draft_extend"] == 0  # prefills stay eager
    rounds = 5 if attention == "torch" else 2
    for items in extend_rounds(7, list(LENGTHS), runner.width, rounds):
        for d in (eager, static):
            d.extend(items)
        want, got = state_of(eager), state_of(static)
        for rid in want:
            assert got[rid][:2] == want[rid][:2]  # committed length, root
            torch.testing.assert_close(got[rid][2], want[rid][2], atol=TOL, rtol=TOL)
            torch.testing.assert_close(got[rid][3], want[rid][3], atol=TOL, rtol=TOL)
            assert torch.equal(got[rid][4], want[rid][4])
        assert static.allocator.num_free == eager.allocator.num_free
    assert runner.replays["draft_extend"] == rounds
    # The next drafts (eager on both, then the static route) see the same committed KV.
    static.graphs = None
    for spec in specs:
        assert_same_trees(static.draft(list(LENGTHS), spec), eager.draft(list(LENGTHS), spec))
    static.graphs = runner
    for spec in specs:
        assert_same_trees(static.draft(list(LENGTHS), spec), eager.draft(list(LENGTHS), spec))
    assert runner.replays["draft"] == len(specs)


def test_drafter_routes_and_falls_back(pair):
    eager, static = pair_drafter(pair), pair_drafter(pair)
    spec, other = SpecConfig(3, 2, 6), SpecConfig(2, 2, 4)
    static.graphs = runner = DraftGraphRunner(static, [spec], buckets=[1, 2, 4], use_graphs=False, attention="torch")
    for d in (eager, static):
        prefill(d)
    calls = [
        ("extend", [("a", *draft_inputs(50, 4))], 1),  # fits: graph
        ("extend", [("a", *draft_inputs(51, 5))], 0),  # wider than num_steps + 1: eager
        ("extend", [("b", *draft_inputs(52, 2)), ("new", *draft_inputs(53, 3))], 0),  # a prefill in the batch: eager
        ("extend", [(r, *draft_inputs(54 + i, 2)) for i, r in enumerate(LENGTHS)], 0),  # 5 requests > bucket 4: eager
        ("draft", ["a", "c", "d"], 1),
        ("draft", list(LENGTHS), 0),
        ("draft_other", ["a", "b"], 0),  # SpecConfig without a graph: eager
    ]
    for kind, arg, routed in calls:
        before = dict(runner.replays)
        if kind == "extend":
            for d in (eager, static):
                d.extend(arg)
            assert runner.replays["draft_extend"] - before["draft_extend"] == routed, arg
        else:
            s = spec if kind == "draft" else other
            assert_same_trees(static.draft(arg, s), eager.draft(arg, s))
            assert runner.replays["draft"] - before["draft"] == routed, arg
    out = static.extend([("c", *draft_inputs(60, 2))], return_logits=True)  # logits of every row: eager
    assert out is not None and runner.replays["draft_extend"] == 1
    assert static.capture_cuda_graphs([spec]) is None  # CPU: no capture, the graphs stay as they are


def test_near_the_context_end_positions_are_clamped(pair):
    eager, static = pair_drafter(pair), pair_drafter(pair)
    spec = SpecConfig(6, 4, 16)
    static.graphs = runner = DraftGraphRunner(static, [spec], buckets=[2], use_graphs=False, attention="torch")
    limit = static.head.max_positions
    for d in (eager, static):
        prefill(d, {"x": limit - 5, "y": 7})
    for n in (3, 2):  # x reaches limit - 2, then exactly the limit; padded tail positions clamp
        items = [("x", *draft_inputs(70 + n, n)), ("y", *draft_inputs(80 + n, n))]
        for d in (eager, static):
            d.extend(items)
        assert_same_trees(static.draft(["x", "y"], spec), eager.draft(["x", "y"], spec))
    assert runner.replays == {"draft": 2, "draft_extend": 2, "draft_prompt": 0}


def test_nan_state_raises_like_eager(pair):
    drafter = pair_drafter(pair)
    prefill(drafter, {"a": 5, "b": 6})
    runner = DraftGraphRunner(drafter, [SpecConfig(3, 2, 6)], buckets=[4], use_graphs=False, attention="torch")
    drafter._reqs["b"].state = torch.full_like(drafter._reqs["b"].state, float("nan"))
    for draft in (lambda: drafter.draft(["a", "b"], SpecConfig(3, 2, 6)),
                  lambda: runner.draft([drafter._reqs["a"], drafter._reqs["b"]], SpecConfig(3, 2, 6))):
        with pytest.raises(FloatingPointError, match="NaN"):
            draft()


def test_runner_rejects_what_the_kernel_cannot_take(pair):
    drafter = pair_drafter(pair)
    with pytest.raises(ConfigError, match="<= 64"):
        DraftGraphRunner(drafter, [SpecConfig(10, 8, 16)], use_graphs=False)
    with pytest.raises(ConfigError, match="max_topk"):
        DraftGraphRunner(drafter, [SpecConfig(2, 9, 4)], use_graphs=False)


@pytest.mark.parametrize("spec", [SpecConfig(1, 1, 2), SpecConfig(3, 1, 4), SpecConfig(5, 1, 6), SpecConfig(5, 1, 3)],
                         ids=str)
def test_deferred_chains_resolve_to_the_eager_trees(extended, spec):
    from tandem.speculative.tree import resolve_pending

    runner = DraftGraphRunner(extended, [spec, SpecConfig(3, 2, 6)], buckets=BUCKETS, use_graphs=False, attention="torch")
    reqs = [extended._reqs[r] for r in LENGTHS]
    trees = runner.draft(reqs, spec, defer=True)
    nd = spec.num_draft_tokens
    for tree, req in zip(trees, reqs):  # the shape is known, the tokens are not
        assert tree.tokens == [req.root] + [-1] * (nd - 1) and tree.parents == list(range(-1, nd - 1))
        assert tree.pending.ids.dtype == torch.int64 and tree.pending.ids.shape == (nd,)
    resolve_pending(trees)
    assert all(t.pending is None for t in trees)
    assert_same_trees(trees, extended.draft(list(LENGTHS), spec))
    # a tree (topk > 1) has no shape before the draft: never deferred
    assert all(t.pending is None for t in runner.draft(reqs, SpecConfig(3, 2, 6), defer=True))


def test_deferred_nan_raises_when_resolved(pair):
    from tandem.speculative.tree import resolve_pending

    drafter = pair_drafter(pair)
    prefill(drafter, {"a": 5, "b": 6})
    runner = DraftGraphRunner(drafter, [SpecConfig(3, 1, 4)], buckets=[4], use_graphs=False, attention="torch")
    drafter._reqs["b"].state = torch.full_like(drafter._reqs["b"].state, float("nan"))
    trees = runner.draft([drafter._reqs["a"], drafter._reqs["b"]], SpecConfig(3, 1, 4), defer=True)
    with pytest.raises(FloatingPointError, match="NaN"):
        resolve_pending(trees)
