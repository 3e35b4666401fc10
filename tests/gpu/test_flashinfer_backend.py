"""FlashInfer attention against the torch reference: decode, causal prefill/extension and tree
verification (random tree masks, W == q_len and W > q_len), eagerly and through CUDA graphs that are
captured once and replayed with new kv lengths, pages and masks. Skipped without a GPU or flashinfer.

The reference runs in float32 on the same (bf16/fp16-rounded) inputs; the pools both backends write
must end up identical.
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.attention.flashinfer_backend import flashinfer_available
from tandem.attention.torch_backend import TorchAttentionBackend
from tandem.forward_batch import ForwardBatch, SequenceChunk, to_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(not flashinfer_available(), reason="needs flashinfer-python"),
]

HQ, HKV, D, PS, NUM_PAGES = 32, 8, 128, 16, 2048  # Llama-3-8B heads
SCALE = D ** -0.5
TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=1e-2, atol=1e-2)}
DTYPES = [torch.bfloat16, torch.float16]


def dev():
    return torch.device("cuda", torch.cuda.current_device())


def tree_mask(rng: random.Random, q_len: int, width: int) -> list[list[bool]]:
    """Rows of the last ``q_len`` of ``width`` tree nodes: each sees its ancestors and itself."""
    parent = [-1] + [rng.randrange(j) for j in range(1, width)]
    rows = []
    for j in range(width - q_len, width):
        row, a = [False] * width, j
        while a >= 0:
            row[a], a = True, parent[a]
        rows.append(row)
    return rows


def build(rng: random.Random, specs):
    """specs: (prefix_len, q_len, tree_mask or None) per sequence → DeviceBatch on scattered pages
    (page 0 never used; sometimes one spare page at the end of a block table)."""
    free = list(range(1, NUM_PAGES))
    rng.shuffle(free)
    chunks = []
    for prefix, n, mask in specs:
        need = -(-(prefix + n) // PS) + rng.randint(0, 1)
        pages, free = free[:need], free[need:]
        depth = [sum(r) - 1 for r in mask] if mask is not None else list(range(n))
        chunks.append(SequenceChunk([1] * n, prefix, pages, positions=[prefix + d for d in depth], tree_mask=mask,
                                    logits="all"))
    return to_device(ForwardBatch(chunks), PS, dev())


def pools(dtype):
    return (torch.randn(NUM_PAGES, PS, HKV, D, device=dev()).to(dtype),
            torch.randn(NUM_PAGES, PS, HKV, D, device=dev()).to(dtype))


def qkv(t: int, dtype):
    return (torch.randn(t, HQ, D, device=dev()).to(dtype), torch.randn(t, HKV, D, device=dev()).to(dtype),
            torch.randn(t, HKV, D, device=dev()).to(dtype))


def reference(meta, q, k, v, kp, vp):
    """Float32 torch attention on copies of the pools → (out, k pool after, v pool after)."""
    rk, rv = kp.float().clone(), vp.float().clone()
    ref = TorchAttentionBackend()
    ref.plan(meta)
    return ref.forward(q.float(), k.float(), v.float(), rk, rv, meta, SCALE), rk, rv


def check(out, kp, vp, expected, dtype):
    ref_out, rk, rv = expected
    assert out.dtype == dtype and out.shape == ref_out.shape
    torch.testing.assert_close(out.float(), ref_out, **TOL[dtype])
    assert torch.equal(kp.float(), rk) and torch.equal(vp.float(), rv)


def run_eager(backend, batch, dtype, layers: int = 2):
    """Plan once, then several 'layers' (each its own pools) as the model does."""
    backend.plan(batch.meta)
    t = batch.input_ids.numel()
    for _ in range(layers):
        kp, vp = pools(dtype)
        q, k, v = qkv(t, dtype)
        expected = reference(batch.meta, q, k, v, kp, vp)
        out = backend.forward(q, k, v, kp, vp, batch.meta, SCALE)
        check(out, kp, vp, expected, dtype)


@pytest.fixture(scope="module")
def backends():
    from tandem.attention.flashinfer_backend import FlashInferBackend

    return {tc: FlashInferBackend(dev(), decode_tensor_cores=tc) for tc in (True, False)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [1, 4, 33])
def test_decode(backends, dtype, bs):
    rng = random.Random(bs)
    edges = [0, PS - 1, PS, 2 * PS - 1, 5 * PS]  # kv_len 1, a full page, one past a page, ...
    specs = [(edges[i] if i < len(edges) else rng.randrange(0, 600), 1, None) for i in range(bs)]
    batch = build(rng, specs)
    for tc in (True, False) if dtype == torch.bfloat16 else (True,):
        run_eager(backends[tc], batch, dtype)
        assert backends[tc]._kind == "decode"


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_causal(backends, dtype):
    rng = random.Random(7)
    specs = [(0, 100, None), (0, 1, None), (37, 16, None), (5, 1, None), (16, 33, None), (200, 7, None), (0, 300, None)]
    batch = build(rng, specs)
    run_eager(backends[True], batch, dtype)
    assert backends[True]._kind == "causal"


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_verify(backends, dtype):
    rng = random.Random(11)
    specs = []
    for i in range(9):
        n = rng.randint(1, 12)
        prefix = rng.randrange(0, 300)
        specs.append((prefix, n, tree_mask(rng, n, n)))  # verification: W == q_len
    specs.append((40, 6, None))  # a causal sequence in a masked batch
    specs.append((3, 1, None))  # and a single token
    for _ in range(3):  # multi-step draft: W > q_len, earlier tree nodes already cached
        n, extra = rng.randint(2, 8), rng.randint(1, 16)
        specs.append((rng.randrange(extra, 200), n, tree_mask(rng, n, n + extra)))
    batch = build(rng, specs)
    run_eager(backends[True], batch, dtype)
    assert backends[True]._kind == "masked"
    # switching kinds back and forth re-plans the right wrapper
    run_eager(backends[True], build(rng, [(9, 1, None), (30, 1, None)]), dtype, layers=1)
    run_eager(backends[True], batch, dtype, layers=1)


def _graph_specs(rng, bs, q_len, masked, max_kv):
    specs = []
    for _ in range(bs):
        prefix = rng.randrange(0, max_kv - q_len + 1)
        specs.append((prefix, q_len, tree_mask(rng, q_len, q_len) if masked and rng.random() < 0.8 else None))
    specs[0] = (max_kv - q_len, q_len, specs[0][2])  # the longest allowed
    return specs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len,masked", [(1, False), (6, True), (4, False)])
def test_graph_replay(dtype, q_len, masked):
    from tandem.attention.flashinfer_backend import FlashInferGraphBackend

    rng, bs, max_kv = random.Random(q_len), 5, 300
    gb = FlashInferGraphBackend(dev(), batch_size=bs, q_len=q_len, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                page_size=PS, max_kv_len=max_kv, dtype=dtype, masked=masked)
    assert gb.kind == ("decode" if q_len == 1 else "masked" if masked else "causal")
    kp, vp = pools(dtype)
    q, k, v = qkv(bs * q_len, dtype)  # static inputs
    first = build(rng, _graph_specs(rng, bs, q_len, masked, max_kv))
    gb.plan(first.meta)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph
        gb.forward(q, k, v, kp, vp, first.meta, SCALE)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gb.forward(q, k, v, kp, vp, first.meta, SCALE)
    for _ in range(4):  # new lengths, pages, masks and contents each replay
        batch = build(rng, _graph_specs(rng, bs, q_len, masked, max_kv))
        for static, new in zip((q, k, v), qkv(bs * q_len, dtype)):
            static.copy_(new)
        expected = reference(batch.meta, q, k, v, kp, vp)
        gb.plan(batch.meta)
        graph.replay()
        torch.cuda.synchronize()
        check(out, kp, vp, expected, dtype)


def test_graph_rejects_other_shapes():
    from tandem.attention.flashinfer_backend import FlashInferGraphBackend

    rng = random.Random(3)
    gb = FlashInferGraphBackend(dev(), batch_size=2, q_len=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                page_size=PS, max_kv_len=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        gb.plan(build(rng, [(3, 1, None)]).meta)  # batch size
    with pytest.raises(ValueError):
        gb.plan(build(rng, [(3, 1, None), (100, 1, None)]).meta)  # max_kv_len
    with pytest.raises(ValueError):
        gb.plan(build(rng, [(3, 1, [[True]]), (4, 1, None)]).meta)  # a mask on a decode graph
