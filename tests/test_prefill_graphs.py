"""Prefill graph families (tandem.engine.prefill_graphs): batches of prompt chunks, each left-padded to a
family's width, give the eager path's last-row logits, per-token features and KV — for a dense model and
for a latent-cache one — on the static path under Triton's interpreter (capture and replay themselves:
tests/gpu/test_engine_gpu.py); which batches a family takes; and an engine's greedy output with them on."""

from __future__ import annotations

import os

import pytest
import torch

from test_graph_static_path import engine, mla_engine  # noqa: F401 (the same tiny models, module-scoped here)

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="runs the Triton kernels: set TRITON_INTERPRET=1 on a CPU machine")


def _prefill_graphs(runner, widths=(8, 16), max_bs=4):
    from tandem.engine.cuda_graph import TargetGraphRunner

    # verify width 5: a speculative engine's runner, whose graphs capture features
    return TargetGraphRunner(runner, widths=(1, 5), max_bs=4, prefill_widths=widths, prefill_max_bs=max_bs)


def _chunks(engine, shapes, seed):
    """Sequences (cached prefix, new tokens): each prefix prefilled eagerly, stale noise in the pool past it
    (the chunk must never see it), → (the chunks, their SequenceKVs, the real tokens' pool slots)."""
    from tandem.forward_batch import ForwardBatch, SequenceChunk
    from tandem.kv_cache import SequenceKV

    runner, ps = engine.executor.runner, engine.executor.runner.cfg.page_size
    g = torch.Generator().manual_seed(seed)
    chunks, kvs, slots = [], [], []
    for prefix, n in shapes:
        prompt = torch.randint(0, 300, (prefix + n,), generator=g).tolist()
        kv = SequenceKV(engine.allocator)
        kv.reserve(prefix + n + 3)  # a page or so past the chunk: stale slots the padding rows' keys would be
        pages = list(kv.pages)
        if prefix:
            runner.forward(ForwardBatch([SequenceChunk(prompt[:prefix], 0, pages)]))
        past = [pages[t // ps] * ps + t % ps for t in range(prefix + n, len(pages) * ps)]
        flat = runner.kv.data.view(*runner.kv.data.shape[:2], -1, *runner.kv.data.shape[-2:])
        flat[:, :, past] = torch.randn(flat[:, :, past].shape, generator=g) * 3
        chunks.append(SequenceChunk(prompt[prefix:], prefix, pages))
        kvs.append(kv)
        slots += [pages[t // ps] * ps + t % ps for t in range(prefix, prefix + n)]
    return chunks, kvs, slots


@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_static_prefill_matches_eager_logits_features_and_kv(model, request):
    """Chunks of 1, 3, exactly 8 and 9 tokens (the 16 family), with and without a cached prefix, several in a
    batch, one padding sequence (3 in bucket 4, after a batch of 4 in the same family): last-row logits, every
    token's features and the real tokens' KV equal the eager path's, and nothing but the dummy page and those slots is
    written."""
    from tandem.attention.graph_backend import TritonGraphBackend
    from tandem.attention.mla_graph_backend import MLAGraphBackend
    from tandem.forward_batch import ForwardBatch
    from tandem.kv_cache import DUMMY_PAGE

    eng = request.getfixturevalue("engine" if model == "llama" else "mla_engine")
    runner = eng.executor.runner
    runner.graph_backend = TritonGraphBackend() if model == "llama" else MLAGraphBackend()
    graphs = _prefill_graphs(runner)
    cases = [([(0, 3), (6, 8), (0, 1)], 8), ([(5, 9), (0, 16), (3, 2)], 16)]
    for seed, (shapes, width) in enumerate(cases):
        # the bucket's four rows real first: the padding row below must not keep this batch's fourth row
        stale, stale_kvs, _ = _chunks(eng, shapes + [(2, width)], seed + 10)
        graphs.run_static_eagerly(ForwardBatch(stale, capture_features=True))
        for kv in stale_kvs:
            kv.release()
        chunks, kvs, slots = _chunks(eng, shapes, seed)
        batch = ForwardBatch(chunks, capture_features=True)
        assert graphs._prefill_family(batch) is graphs.prefill[width]
        before = runner.kv.data.clone()
        eager_logits, eager_feats = runner.forward(batch)
        eager_kv = runner.kv.data.clone()
        runner.kv.data.copy_(before)
        static_logits, static_feats = graphs.run_static_eagerly(batch)
        assert static_logits.shape == (len(chunks), eager_logits.shape[1])
        torch.testing.assert_close(static_logits, eager_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(static_feats, eager_feats, rtol=1e-4, atol=1e-4)
        flat = lambda t: t.view(*t.shape[:2], -1, *t.shape[-2:])  # noqa: E731  [entries, layers, slots, ...]
        torch.testing.assert_close(flat(runner.kv.data)[:, :, slots], flat(eager_kv)[:, :, slots], rtol=1e-4, atol=1e-4)
        ps = runner.cfg.page_size
        untouched = torch.ones(flat(before).shape[2], dtype=torch.bool)
        untouched[slots] = False
        untouched[DUMMY_PAGE * ps : (DUMMY_PAGE + 1) * ps] = False
        assert torch.equal(flat(runner.kv.data)[:, :, untouched], flat(before)[:, :, untouched])
        for kv in kvs:
            kv.release()


def test_prefill_family_takes_only_batches_of_short_prompt_chunks(engine):
    from tandem.forward_batch import ForwardBatch, SequenceChunk

    runner = engine.executor.runner
    graphs = _prefill_graphs(runner, widths=(16, 32, 64, 128), max_bs=8)
    pages = list(range(1, 40))

    def chunk(n, prefix=0, **kw):
        return SequenceChunk(list(range(3, 3 + n)), prefix, pages, **kw)

    def family(*seqs, features=False):
        batch = ForwardBatch(list(seqs), capture_features=features)
        fam = graphs._prefill_family(batch)
        assert graphs.can_run(batch) == (fam is not None)  # (none of these fits a decode or verify family)
        return fam.width if fam is not None else None

    assert family(chunk(3)) == 16 and family(chunk(16), chunk(2, prefix=9)) == 16
    assert family(chunk(17), chunk(4)) == 32 and family(chunk(100, prefix=20), features=True) == 128
    assert family(*[chunk(100)] * 8) == 128  # 8 prompts of 100: 1024 rows for 800
    assert family(chunk(129)) is None  # longer than the widest family
    assert family(*[chunk(3)] * 9) is None  # more sequences than the largest bucket
    assert family(chunk(128), *[chunk(1)] * 4) is None  # 1024 padded rows (bucket 8) for 132: eager
    assert family(chunk(6, logits="all")) is None  # prompt logprobs: every row's logits
    assert family(chunk(6, logits="none")) is None
    assert family(chunk(6, tree_mask=[[True] * 6] * 6)) is None
    assert family(chunk(6, positions=list(range(6)))) is None
    assert family(chunk(6, device_ids=torch.arange(6))) is None
    # a speculating batch: prompts beside verify rows (tree masks, every row's logits)
    verify = SequenceChunk([7, 8, 9, 10, 11], 12, pages, tree_mask=[[True] * 5] * 5, logits="all")
    assert family(chunk(10), verify) is None
    # a batch of one-token chunks is a decode step: the decode family's (or eager past its buckets), never a prefill's
    assert graphs._prefill_family(ForwardBatch([chunk(1), chunk(1, prefix=4)])) is None
    assert graphs._prefill_family(ForwardBatch([chunk(1)] * 5)) is None
    assert graphs._uniform_fits(ForwardBatch([chunk(1), chunk(1, prefix=4)]))
    # features asked of graphs captured without them (no verify width, no traffic capture): eager
    plain = type(graphs)(runner, widths=(1,), max_bs=4, prefill_widths=(16,), prefill_max_bs=4)
    assert plain.can_run(ForwardBatch([chunk(5)])) and not plain.can_run(ForwardBatch([chunk(5)], capture_features=True))
    assert type(graphs)(runner, widths=(1,), max_bs=4).prefill == {}  # prefill_graph_tokens 0: none


def test_prefill_widths_and_buckets():
    from tandem.prefill_shapes import prefill_buckets, prefill_widths

    assert prefill_widths(128) == (16, 32, 64, 128) and prefill_widths(100) == (16, 32, 64, 100)
    assert prefill_widths(8) == (8,) and prefill_widths(0) == ()
    assert prefill_buckets(8) == [1, 2, 4, 8] and prefill_buckets(6) == [1, 2, 4, 6] and prefill_buckets(1) == [1]


def test_engine_greedy_with_prefill_graphs_equals_without(tmp_path, monkeypatch):
    """A static-path engine (graphs' code without capture) with prefill families and without them: prompts
    arrive while others decode (prefill steps apart), and their greedy outputs agree; the prefill family ran."""
    from helpers import TorchGraphBackend, generate_with_arrivals, torch_prompts
    from tandem.engine.config import EngineConfig
    from tandem.engine.cuda_graph import TargetGraphRunner
    from tandem.engine.llm_engine import LLMEngine
    from tandem.models.random_checkpoint import LlamaShape, write_random_llama
    from tandem.sampling import SamplingParams

    path = write_random_llama(tmp_path / "t", LlamaShape(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        max_position_embeddings=256), seed=8, std=0.08)
    launched = []
    launch = TargetGraphRunner._launch
    monkeypatch.setattr(TargetGraphRunner, "_launch", lambda self, member, bs: launched.append(member) or
                        launch(self, member, bs))
    prompts = torch_prompts(9, (5, 12, 3, 20, 9, 30))
    outputs = {}
    for tokens in (32, 0):
        # torch attention in the graphs (the Triton kernels' static path is the test above's)
        monkeypatch.setattr("tandem.attention.graph_backend.make_graph_backend", lambda latent=False: TorchGraphBackend())
        cfg = EngineConfig(model=str(path), page_size=4, static_graph_path=True, cuda_graph_max_bs=4, decode_steps=1,
                           prefill_graph_tokens=tokens, prefill_graph_max_bs=4)
        with LLMEngine(cfg) as eng:
            assert eng.prefill_apart
            outputs[tokens] = generate_with_arrivals(eng, prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))[1]
        prefills = [m for m in launched if isinstance(m, tuple)]
        assert (len(prefills) >= 3) == (tokens > 0), prefills  # the first prompts, then each pair of arrivals
        launched.clear()
    assert outputs[32] == outputs[0]


def test_a_decode_run_wider_than_the_decode_graphs_but_within_a_prefill_bucket_runs(tmp_path, monkeypatch):
    """--cuda-graph-max-bs 2 with --prefill-graph-max-bs 4: a run of decode steps of 3 requests fits no decode
    graph and runs eagerly; three one-token chunks are not a prefill family's (whose graphs a run cannot step),
    and the output is the eager engine's."""
    from helpers import TorchGraphBackend, torch_prompts
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.models.random_checkpoint import LlamaShape, write_random_llama
    from tandem.sampling import SamplingParams

    path = write_random_llama(tmp_path / "t", LlamaShape(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        max_position_embeddings=256), seed=8, std=0.08)
    monkeypatch.setattr("tandem.attention.graph_backend.make_graph_backend", lambda latent=False: TorchGraphBackend())
    prompts = torch_prompts(9, (5, 12, 3))
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    outputs = {}
    for graphs in (True, False):
        cfg = EngineConfig(model=str(path), page_size=4, static_graph_path=graphs, cuda_graph_max_bs=2,
                           decode_steps=4, prefill_graph_tokens=16, prefill_graph_max_bs=4)
        with LLMEngine(cfg) as eng:
            outputs[graphs] = [r.output_token_ids for r in eng.generate(prompts, params)]
    assert outputs[True] == outputs[False]
