"""On the GPU: the drafter's CUDA graphs (draft, draft_extend, draft_prompt; tandem/speculative/draft_graph.py,
draft_prompt_graphs.py).

- capture: one log line per family in the format of docs/architecture.md, "CUDA graphs", every
  (SpecConfig, bucket) captured, the watchdog silent, nothing written outside the dummy page 0;
- replay with changed inputs: rounds of random batches (1–8 requests on buckets 1/2/4/8, so most carry
  padding rows; the first is one request drafting a tree, whose expanded positions have stride 0),
  random SpecConfigs and random extend widths ≤ num_steps + 1 on scattered pages; every
  graphed draft equals the eager drafter's tree (tokens and parents exactly, scores within 1e-4) and
  every graphed extend leaves the same lengths, roots, states, top-k and committed KV as an eager twin;
  then new prompts and a chunk going on from a request's KV on the prompt-extend family, likewise.
  float32 with the torch attention backend for the eager side, so both agree to rounding;
- timing (run with -s): a Llama-3-8B-shaped head in bf16, eager vs graphed draft and extend per batch, and
  eager vs graphed prompt extends.
"""

from __future__ import annotations

import logging
import random
import re
import time

import pytest
import torch

from draft_checkpoints import shared_pair
from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
from tandem.speculative.spec_config import SpecConfig
from tandem.watchdog import Watchdog

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LOG_LINE = re.compile(r"^Capture (draft|draft_extend|draft_prompt) cuda graph end\. Time elapsed: \d+\.\d\d s\. "
                      r"mem usage=-?\d+\.\d\d GB\. avail mem=\d+\.\d\d GB\.$")
SPECS = [SpecConfig(6, 4, 16), SpecConfig(3, 1, 4), SpecConfig(4, 2, 8)]
LENGTHS = [5, 17, 40, 63, 100, 129, 250, 300]  # committed draft KV per request, across pages of 16
TOL = 1e-4


@pytest.fixture(scope="module")
def pair(checkpoint, tmp_path_factory):
    return shared_pair(checkpoint, tmp_path_factory)


def make(pair, **kw) -> Eagle3Drafter:
    cfg = DrafterConfig(device="cuda", dtype="float32", attention_backend="torch", page_size=16, kv_pages=1024,
                        page_shuffle_seed=5, **kw)
    return Eagle3Drafter.from_dirs(str(pair.draft_dir), str(pair.target_dir), cfg)


def inputs(seed: int, n: int, width: int = 192, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (n,), generator=g).tolist()
    return tokens, torch.randn(n, width, generator=g).to("cuda", dtype)


def committed_kv(drafter, rid):
    r = drafter._reqs[rid]
    flat = drafter.kv.data.view(2, -1, *drafter.kv.data.shape[-2:])
    return flat[:, [r.kv.slot(i) for i in range(r.kv.num_tokens)]]


def test_capture_then_replay_equals_eager(pair, caplog):
    watchdog = Watchdog(exit_code=None)
    eager, graphed = make(pair), make(pair, cuda_graph_max_bs=8, prefill_graph_tokens=64, prefill_graph_max_bs=4)
    with caplog.at_level(logging.INFO, logger="tandem.draft_graph"):
        report = graphed.capture_cuda_graphs(SPECS, watchdog=watchdog, buckets=[1, 2, 4, 8])
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.draft_graph"]
    print("\n" + "\n".join(lines))
    families = ["draft", "draft_extend", "draft_prompt"]
    assert [m.group(1) for m in map(LOG_LINE.match, lines) if m] == families, lines
    assert set(report) == set(families)
    runner = graphed.graphs
    assert set(runner.graphs) == ({(s, bs) for s in SPECS for bs in (1, 2, 4, 8)}
                                  | {("extend", bs) for bs in (1, 2, 4, 8)}
                                  | {(("prompt", w), bs) for w in (16, 32, 64) for bs in (1, 2, 4)})
    assert not graphed.kv.data[:, :, 1:].any(), "capture wrote outside the dummy page"
    assert runner.width == 7

    rids = [f"r{i}" for i in range(len(LENGTHS))]
    prefill = [(rid, *inputs(i, n)) for i, (rid, n) in enumerate(zip(rids, LENGTHS))]
    for d in (eager, graphed):
        d.extend(prefill)
    assert runner.replays["draft_extend"] == runner.replays["draft_prompt"] == 0  # 8 prompts, to 300 tokens: eager

    rng = random.Random(0)
    rounds = 16
    for r in range(rounds):
        batch = rng.sample(rids, 1 if r == 0 else rng.randint(1, 8))
        spec = SPECS[0] if r == 0 else rng.choice(SPECS)  # round 0: a tree at batch 1
        got, want = graphed.draft(batch, spec), eager.draft(batch, spec)
        for g, w in zip(got, want):
            assert g.tokens == w.tokens and g.parents == w.parents, (r, spec, batch)
            assert g.scores == pytest.approx(w.scores, abs=TOL)
        # the verifier accepted a path of 0..num_steps nodes: extend by accepted + bonus
        items = [(rid, *inputs(1000 + 10 * r + i, rng.randint(1, spec.num_steps + 1))) for i, rid in enumerate(batch)]
        for d in (eager, graphed):
            d.extend(items)
        for rid in rids:
            e, g = eager._reqs[rid], graphed._reqs[rid]
            assert (g.kv.num_tokens, g.root) == (e.kv.num_tokens, e.root)
            torch.testing.assert_close(g.state, e.state, atol=TOL, rtol=TOL)
            torch.testing.assert_close(g.top_logp, e.top_logp, atol=TOL, rtol=TOL)
            assert torch.equal(g.top_ids, e.top_ids)
        assert graphed.allocator.num_free == eager.allocator.num_free
    assert runner.replays == {"draft": rounds, "draft_extend": rounds, "draft_prompt": 0}
    # new prompts (bucket 4, width 64), then a chunk going on from one of them and a new one (width 32)
    for batch in ([("p0", *inputs(90, 3)), ("p1", *inputs(91, 17)), ("p2", *inputs(92, 40))],
                  [("p1", *inputs(93, 30)), ("p3", *inputs(94, 9))]):
        for d in (eager, graphed):
            d.extend(batch)
    assert runner.replays["draft_prompt"] == 2
    for rid in rids + ["p0", "p1", "p2", "p3"]:
        e, g = eager._reqs[rid], graphed._reqs[rid]
        assert (g.kv.num_tokens, g.root) == (e.kv.num_tokens, e.root)
        torch.testing.assert_close(g.state, e.state, atol=TOL, rtol=TOL)
        torch.testing.assert_close(g.top_logp, e.top_logp, atol=TOL, rtol=TOL)
        assert torch.equal(g.top_ids, e.top_ids)
        torch.testing.assert_close(committed_kv(graphed, rid), committed_kv(eager, rid), atol=TOL, rtol=TOL)
    assert graphed.allocator.num_free == eager.allocator.num_free
    for spec in SPECS:
        for g, w in zip(graphed.draft(["p0", "p1", "p2", "p3"], spec), eager.draft(["p0", "p1", "p2", "p3"], spec)):
            assert g.tokens == w.tokens and g.parents == w.parents
    assert watchdog.fired == []


def test_disabled_or_too_large_batches_stay_eager(pair):
    assert make(pair, disable_cuda_graph=True).capture_cuda_graphs(SPECS) is None
    eager, graphed = make(pair), make(pair, cuda_graph_max_bs=2, prefill_graph_tokens=0)  # no prompt families
    graphed.capture_cuda_graphs([SPECS[1]], watchdog=Watchdog(exit_code=None))
    items = [(f"r{i}", *inputs(i, 9 + i)) for i in range(3)]
    for d in (eager, graphed):
        d.extend(items)
        d.extend([(rid, *inputs(50, 3)) for rid, _, _ in items])  # 3 requests > bucket 2: eager
    rids = [rid for rid, _, _ in items]
    assert graphed.draft(rids, SPECS[1]) == eager.draft(rids, SPECS[1])
    assert graphed.graphs.replays == {"draft": 0, "draft_extend": 0, "draft_prompt": 0}


# -- timing -----------------------------------------------------------------------------------------
def llama8b_head(dtype=torch.bfloat16, max_positions=4096):
    """A random head of Llama-3-8B's EAGLE-3 shape (H 4096, 32/8 heads, draft vocab 32000)."""
    from tandem.models.loader import default_dtype
    from tandem.configs.model import RopeConfig
    from tandem.models.eagle3 import Eagle3Head
    from tandem.configs.eagle3 import DraftConfig

    cfg = DraftConfig(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128,
                      rms_norm_eps=1e-5, rope=RopeConfig(theta=500000.0), max_position_embeddings=max_positions,
                      vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096, aux_layer_ids=None,
                      fc_bias=False, dtype="bfloat16")
    g = torch.Generator("cuda").manual_seed(0)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", generator=g).to(dtype)
    with torch.device("cuda"), default_dtype(dtype):
        head = Eagle3Head(cfg, embed, max_positions).eval()
    for p in head.parameters():
        if p.dim() == 2:
            p.data.normal_(0.0, p.shape[1] ** -0.5, generator=g)
        else:
            p.data.normal_(1.0, 0.1, generator=g)
    ids = torch.randperm(cfg.vocab_size, device="cuda", generator=g)[: cfg.draft_vocab_size].sort().values
    head.d2t.copy_(ids - torch.arange(cfg.draft_vocab_size, device="cuda"))
    head.t2d.zero_()
    head.t2d[ids] = True
    return head


def ms(fn, iters=10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


@pytest.mark.slow
def test_timing_llama8b_shaped_head(caplog):
    specs = [SpecConfig(3, 1, 4), SpecConfig(6, 4, 16), SpecConfig(5, 8, 32)]
    batches, context = (1, 8, 32, 64), 1024
    head = llama8b_head()
    drafter = Eagle3Drafter(head, DrafterConfig(device="cuda", page_size=16, kv_pages=64 * 128, max_topk=8,
                                                cuda_graph_max_bs=64))
    with caplog.at_level(logging.INFO, logger="tandem.draft_graph"):
        drafter.capture_cuda_graphs(specs, watchdog=Watchdog(exit_code=None))
    print("\n" + "\n".join(r.getMessage() for r in caplog.records if r.name == "tandem.draft_graph"))
    runner = drafter.graphs
    rids = [f"r{i}" for i in range(max(batches))]
    for i, rid in enumerate(rids):
        drafter.extend([(rid, *inputs(i, context, width=3 * 4096, dtype=torch.bfloat16))])
    print(f"{'spec':>10} {'bs':>3} | draft eager / graph ms | extend eager / graph ms | same trees")
    for spec in specs:
        for bs in batches:
            batch = rids[:bs]
            items = [(rid, *inputs(7 + j, spec.num_steps + 1, width=3 * 4096, dtype=torch.bfloat16))
                     for j, rid in enumerate(batch)]
            drafter.graphs = None  # eager
            eager_trees = drafter.draft(batch, spec)
            d_eager = ms(lambda: drafter.draft(batch, spec))
            drafter.graphs = runner
            graph_trees = drafter.draft(batch, spec)  # drafting changes nothing: same state as the eager one
            d_graph = ms(lambda: drafter.draft(batch, spec))
            drafter.graphs = None  # each extend appends num_steps + 1 tokens per request (room is reserved)
            x_eager = ms(lambda: drafter.extend(items), iters=3)
            drafter.graphs = runner
            x_graph = ms(lambda: drafter.extend(items), iters=3)
            same = sum(a.tokens == b.tokens and a.parents == b.parents for a, b in zip(eager_trees, graph_trees))
            name = f"{spec.num_steps}/{spec.topk}/{spec.num_draft_tokens}"
            print(f"{name:>10} {bs:>3} | {d_eager:8.2f} / {d_graph:6.2f} ({d_eager / d_graph:4.1f}x) | "
                  f"{x_eager:8.2f} / {x_graph:6.2f} ({x_eager / x_graph:4.1f}x) | {same}/{bs}")
            assert all(t.size == spec.num_draft_tokens for t in graph_trees)
    assert runner.replays["draft"] > 0 and runner.replays["draft_extend"] > 0


@pytest.mark.slow
def test_timing_prompt_extends_llama8b_shaped_head(caplog):
    """New prompts extended into a Llama-3-8B-shaped head (bf16), eagerly and on the prompt-extend family."""
    drafter = Eagle3Drafter(llama8b_head(), DrafterConfig(device="cuda", page_size=16, kv_pages=64 * 128))
    with caplog.at_level(logging.INFO, logger="tandem.draft_graph"):
        drafter.capture_cuda_graphs([SpecConfig(3, 1, 4)], watchdog=Watchdog(exit_code=None))
    print("\n" + "\n".join(r.getMessage() for r in caplog.records if r.name == "tandem.draft_graph"))
    runner = drafter.graphs
    print(f"{'bs':>3} {'tokens':>6} | prompt extend eager / graph ms")
    for bs, n in ((1, 16), (1, 100), (2, 128), (4, 40), (8, 64), (8, 100)):
        items = [(f"n{j}", *inputs(j, n, width=3 * 4096, dtype=torch.bfloat16)) for j in range(bs)]

        def extend_new():
            drafter.extend(items)
            for rid, _, _ in items:
                drafter.release(rid)

        drafter.graphs = None
        eager = ms(extend_new, iters=5)
        drafter.graphs = runner
        before = runner.replays["draft_prompt"]
        graphed = ms(extend_new, iters=5)
        assert runner.replays["draft_prompt"] == before + 6
        print(f"{bs:>3} {n:>6} | {eager:8.2f} / {graphed:6.2f} ({eager / graphed:4.1f}x)")
