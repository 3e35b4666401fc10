"""A tiny DeepSeek-V3 engine on the MLA kernel route (``attention_backend="triton"``: the Triton latent
kernel for every absorbed forward, run here under the interpreter, and torch's fused causal attention
for fresh prompts) against the same checkpoint on the torch reference route: prompt logits of a batch,
decode logits, a chunk after a cached prefix, a branching tree's logits, greedy tokens of a batch of
different lengths over scattered pages, and tree speculation (random trees holding the reference
continuation). The kernel's launches are counted, so a silent fallback to the reference would fail; so
are the absorbed projections' kernels (tandem/kernels/mla_absorb.py) and torch's einsums, which only a
forward of more rows than the kernels take still runs."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CPU engines through the interpreter; on a GPU: tests/gpu/test_mla_kernel_gpu.py",
                allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit
pytest.importorskip("triton")

from deepseek_checkpoints import write_deepseek  # noqa: E402
from helpers import assert_rel, manual_greedy_logits, random_prompt  # noqa: E402
from proposers import RandomTreeProposer, Spec, always_speculate  # noqa: E402
from tandem.forward_batch import ForwardBatch, SequenceChunk  # noqa: E402
from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.kv_cache import SequenceKV  # noqa: E402
from tandem.sampling import SamplingParams  # noqa: E402

VOCAB = 512


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("mla-kernel-route")
    write_deepseek(path, seed=21, num_hidden_layers=3)
    return str(path)


@pytest.fixture(scope="module")
def launches():
    """Counts the latent kernel's calls (``n``), the absorbed projections' (``absorb_q``, ``absorb_out``) and
    torch's einsums (patched for the whole module, restored after)."""
    from tandem.kernels import mla_absorb, mla_attention

    calls = {"n": 0, "absorb_q": 0, "absorb_out": 0, "einsum": 0}
    patched = [(mla_attention, "mla_paged_attention", "n"), (mla_absorb, "absorb_q", "absorb_q"),
               (mla_absorb, "absorb_out", "absorb_out"), (torch, "einsum", "einsum")]
    originals = [getattr(mod, name) for mod, name, _ in patched]

    def counter(original, key):
        def counted(*args, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)
        return counted

    for (mod, name, key), original in zip(patched, originals):
        setattr(mod, name, counter(original, key))
    yield calls
    for (mod, name, _), original in zip(patched, originals):
        setattr(mod, name, original)


def _since(launches, before: dict) -> dict:
    return {k: launches[k] - before[k] for k in launches}


@pytest.fixture(scope="module")
def engines(folder, launches):
    cfg = dict(model=folder, page_size=4, page_shuffle_seed=3, chunked_prefill_size=24)
    opened = {route: LLMEngine(EngineConfig(attention_backend=route, **cfg)) for route in ("torch", "triton")}
    assert opened["triton"].executor.runner.backend.name == "triton-mla"
    assert opened["torch"].executor.runner.backend.name == "torch-mla"
    yield opened
    for eng in opened.values():
        eng.shutdown()


def test_prompt_logits_of_a_batch_equal_the_reference_route(engines, launches):
    """Fresh prompts only: the plain form, no kernel launch."""
    before = launches["n"]
    prompts = [random_prompt(20 + n, n, VOCAB) for n in (1, 9, 22)]
    logits = {}
    for route, eng in engines.items():
        kvs = [SequenceKV(eng.allocator) for _ in prompts]
        try:
            for kv, p in zip(kvs, prompts):
                kv.reserve(len(p))
            chunks = [SequenceChunk(p, 0, kv.page_table(), logits="all") for kv, p in zip(kvs, prompts)]
            logits[route], _ = eng.executor.forward(ForwardBatch(chunks))
        finally:
            for kv in kvs:
                kv.release()
    assert launches["n"] == before
    assert_rel(logits["triton"], logits["torch"], 1e-4, "prompts")


def test_decode_logits_equal_the_reference_route(engines, launches):
    prompt = random_prompt(1, 11, VOCAB)
    ref_tokens, ref_rows = manual_greedy_logits(engines["torch"], prompt, 6)
    before = dict(launches)
    tokens, rows = manual_greedy_logits(engines["triton"], prompt, 6)
    # every decode step, every layer: the latent kernel and both projections' kernels, no einsum
    assert _since(launches, before) == {"n": 6 * 3, "absorb_q": 6 * 3, "absorb_out": 6 * 3, "einsum": 0}
    assert tokens == ref_tokens
    assert_rel(rows, ref_rows, 1e-4, "decode")


def _chunk_then_tree(eng) -> tuple[torch.Tensor, torch.Tensor]:
    """A 7-token chunk after 23 cached, then a 5-node tree after those 30 (root's children a, b; a's c, d;
    b's e): the logits of both forwards."""
    prompt, nodes, parents, depth = random_prompt(2, 30, VOCAB), [7, 8, 9, 10, 11], [-1, -1, 0, 0, 1], [0, 0, 1, 1, 1]
    mask = [[j == i or parents[i] == j for j in range(5)] for i in range(5)]
    kv = SequenceKV(eng.allocator)
    try:
        kv.reserve(35)
        eng.executor.forward(ForwardBatch([SequenceChunk(prompt[:23], 0, kv.page_table(), logits="none")]))
        chunk, _ = eng.executor.forward(ForwardBatch([SequenceChunk(prompt[23:], 23, kv.page_table(), logits="all")]))
        tree = SequenceChunk(nodes, 30, kv.page_table(), positions=[30 + d for d in depth], tree_mask=mask,
                             logits="all")
        tree_logits, _ = eng.executor.forward(ForwardBatch([tree]))
    finally:
        kv.release()
    return chunk, tree_logits


def test_chunk_and_tree_logits_equal_the_reference_route(engines, launches):
    ref_chunk, ref_tree = _chunk_then_tree(engines["torch"])
    before = dict(launches)
    chunk, tree = _chunk_then_tree(engines["triton"])
    # the chunk (7 rows) and the tree (5), both within mla_absorb.MAX_ROWS; the fresh prefix is the plain form
    assert _since(launches, before) == {"n": 2 * 3, "absorb_q": 2 * 3, "absorb_out": 2 * 3, "einsum": 0}
    assert_rel(chunk, ref_chunk, 1e-4, "chunk")
    assert_rel(tree, ref_tree, 1e-4, "tree")


def _long_chunk(eng) -> torch.Tensor:
    """A 20-token chunk after 5 cached: more rows than mla_absorb.MAX_ROWS. Its logits."""
    prompt = random_prompt(3, 25, VOCAB)
    kv = SequenceKV(eng.allocator)
    try:
        kv.reserve(25)
        eng.executor.forward(ForwardBatch([SequenceChunk(prompt[:5], 0, kv.page_table(), logits="none")]))
        logits, _ = eng.executor.forward(ForwardBatch([SequenceChunk(prompt[5:], 5, kv.page_table(), logits="all")]))
    finally:
        kv.release()
    return logits


def test_a_chunk_beyond_the_absorb_kernels_rows_keeps_the_einsums(engines, launches):
    reference = _long_chunk(engines["torch"])
    before = dict(launches)
    logits = _long_chunk(engines["triton"])
    assert _since(launches, before) == {"n": 3, "absorb_q": 0, "absorb_out": 0, "einsum": 2 * 3}
    assert_rel(logits, reference, 1e-4, "long chunk")


def test_greedy_tokens_of_a_mixed_batch_equal_the_reference_route(engines, launches):
    prompts = [random_prompt(10 + n, n, VOCAB) for n in (3, 17, 40)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    reference = [r.output_token_ids for r in engines["torch"].generate(prompts, params)]
    before = launches["n"]
    assert [r.output_token_ids for r in engines["triton"].generate(prompts, params)] == reference
    assert launches["n"] > before


def test_tree_speculation_equals_the_reference_route(folder, engines, launches):
    prompts = [random_prompt(30 + n, n, VOCAB) for n in (5, 23)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    reference = [r.output_token_ids for r in engines["torch"].generate(prompts, params)]
    oracle = {f"r{i}": p + out for i, (p, out) in enumerate(zip(prompts, reference))}
    runs = {}
    for route in ("torch", "triton"):
        proposer = RandomTreeProposer(vocab=VOCAB, seed=4, oracle=oracle, hit_rate=0.8)
        cfg = EngineConfig(model=folder, page_size=3, page_shuffle_seed=5, attention_backend=route)
        with LLMEngine(cfg, proposer=proposer, spec=Spec(6), policy=always_speculate()) as eng:
            rids = [eng.add_request(p, params, rid=f"r{i}") for i, p in enumerate(prompts)]
            while eng.has_unfinished():
                eng.step()
            runs[route] = ([eng.requests[r].output for r in rids],
                           [eng.requests[r].spec_stats.accept_length_mean for r in rids])
    assert runs["triton"][0] == reference
    assert runs["triton"] == runs["torch"]
    assert min(runs["triton"][1]) > 1.5  # long paths were accepted: trees really were verified


@pytest.mark.parametrize("merged_here", [False, True])
def test_decode_with_split_keys_equals_the_reference_route(engines, launches, monkeypatch, merged_here):
    """On a GPU the latent kernel splits a long context's keys (on the CPU it never does: forced here, four ways):
    the merge kernel merges them, or with ``MERGE_SPLITS_HERE`` the absorb kernel as it reads them (no merge kernel
    runs); decode is the reference's either way."""
    from tandem.kernels import mla_absorb, mla_attention

    monkeypatch.setattr(mla_absorb, "MERGE_SPLITS_HERE", merged_here)
    monkeypatch.setattr(mla_absorb, "SPLIT_PROGRAMS_PER_HEAD", 2)
    merges = []
    monkeypatch.setattr(mla_attention, "default_num_splits", lambda *args: 4)
    real_merge = mla_attention.merge_splits
    monkeypatch.setattr(mla_attention, "merge_splits", lambda *args: merges.append(1) or real_merge(*args))
    prompt = random_prompt(5, 21, VOCAB)
    ref_tokens, ref_rows = manual_greedy_logits(engines["torch"], prompt, 4)
    before = dict(launches)
    tokens, rows = manual_greedy_logits(engines["triton"], prompt, 4)
    assert _since(launches, before) == {"n": 4 * 3, "absorb_q": 4 * 3, "absorb_out": 4 * 3, "einsum": 0}
    assert len(merges) == (0 if merged_here else 4 * 3) and tokens == ref_tokens
    assert_rel(rows, ref_rows, 1e-4, "decode, split keys")
