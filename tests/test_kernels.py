"""Triton kernels against plain-torch references (tandem's own reference code: TorchAttentionBackend,
RotaryEmbedding's formula, RMSNorm's formula), on the CPU under the Triton interpreter.

Inputs are random (never zeros), outputs are poisoned with NaN before each call so an element the
kernel forgot to write fails, pages are scattered, prefixes cross page boundaries, and trees are
random (parent < child; a node sees its ancestors and itself). The helpers are shared with
tests/gpu/test_kernels_gpu.py, which runs the same checks larger, in bf16/fp16 and under CUDA graphs.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit (import below)
pytest.importorskip("triton")

from helpers import norm_rel_err  # noqa: E402
from tandem.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tandem.forward_batch import ForwardBatch, SequenceChunk, to_device  # noqa: E402
from tandem.kernels import paged_attention, rms_norm, rotary_and_store, silu_and_mul, store_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"


def random_tree_mask(rng: random.Random, n: int, width: int) -> list[list[bool]]:
    """[n, width] mask over the last ``width`` keys: a random tree of ``width`` nodes (parent < child),
    each of the last ``n`` nodes seeing its ancestors and itself."""
    parent = [-1] + [rng.randrange(j) for j in range(1, width)]
    rows = []
    for node in range(width - n, width):
        seen = [False] * width
        while node >= 0:
            seen[node], node = True, parent[node]
        rows.append(seen)
    return rows


def attention_case(batch, q_len, group, num_kv_heads, head_dim, page_size, dtype, device, *, seed,
                   mask_width=None, max_prefix=90, pad_last=False, num_pages=None, max_pages=None):
    """Random sequences on scattered pages; returns the kernel's inputs and the reference output.

    The new K/V are written into the pools (as the rotary/store kernel would have done), the
    reference is TorchAttentionBackend in float32 on the same (rounded) values, and every pool slot
    that no sequence owns is then poisoned with NaN, except the dummy page 0, so a load past
    ``kv_len`` shows. ``mask_width``: None = causal, else a tree mask over that many last keys.
    ``pad_last``: the last sequence is a CUDA-graph padding row (kv_len 1 on page 0)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lo = 0 if mask_width is None else mask_width - q_len  # the tree's older nodes are already cached
    lens = [rng.randint(lo, max(lo, max_prefix)) for _ in range(batch - pad_last)]
    num_pages = num_pages or sum(-(-(p + q_len) // page_size) for p in lens) + 3
    free = list(range(1, num_pages))  # page 0 is the dummy page
    rng.shuffle(free)
    seqs, masks = [], []
    for prefix in lens:
        pages = [free.pop() for _ in range(-(-(prefix + q_len) // page_size))]
        tree = random_tree_mask(rng, q_len, mask_width) if mask_width else None
        masks.append(tree)
        seqs.append(SequenceChunk(token_ids=[1] * q_len, prefix_len=prefix, pages=pages, tree_mask=tree, logits="all"))
    meta = to_device(ForwardBatch(seqs), page_size, torch.device(device)).meta
    t_real, hq = len(seqs) * q_len, group * num_kv_heads

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    k_pool, v_pool = randn(num_pages, page_size, num_kv_heads, head_dim), randn(num_pages, page_size, num_kv_heads, head_dim)
    q, k, v = randn(t_real, hq, head_dim), randn(t_real, num_kv_heads, head_dim), randn(t_real, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    backend = TorchAttentionBackend()
    backend.plan(meta)
    ref = backend.forward(q.float(), k.float(), v.float(), k_pool.float(), v_pool.float(), meta, scale)
    for pool, new in ((k_pool, k), (v_pool, v)):
        pool.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, new)
    owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
    owned[:page_size] = True
    for sq in seqs:
        for t in range(sq.prefix_len + q_len):
            owned[sq.pages[t // page_size] * page_size + t % page_size] = True
    for pool in (k_pool, v_pool):
        pool.view(-1, num_kv_heads, head_dim)[~owned.to(device)] = float("nan")

    width = max(max_pages or 0, meta.block_tables.shape[1])
    tables = torch.zeros(batch, width, dtype=torch.int32, device=device)  # padding rows: all page 0
    tables[: len(seqs), : meta.block_tables.shape[1]] = meta.block_tables
    kv_lens = torch.ones(batch, dtype=torch.int32, device=device)  # padding rows: kv_len 1
    kv_lens[: len(seqs)] = meta.kv_lens
    q = torch.cat([q, randn((batch - len(seqs)) * q_len, hq, head_dim)])
    mask = None
    if mask_width is not None:
        mask = torch.ones(batch, q_len, mask_width, dtype=torch.bool, device=device)
        mask[: len(seqs)] = torch.tensor(masks, dtype=torch.bool, device=device)
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=tables, kv_lens=kv_lens, mask=mask,
                scale=scale, ref=ref, t_real=t_real)



def rotary_reference(q, k, cos, sin, positions):
    """RotaryEmbedding.forward's formula (the tables cast to the activation dtype, as HF does)."""
    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return q * c + rot(q) * s, k * c + rot(k) * s


def rotary_tables(max_pos, head_dim, device):
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(device), ang.sin().to(device)


def rms_norm_reference(x, weight, eps):
    """tandem.layers.norm.RMSNorm.forward."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_and_mul_reference(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------- attention
# (batch, q_len, group, kv heads, head_dim, page_size, mask width or None = causal, pad_last, splits)
ATTENTION_CASES = [
    (1, 1, 1, 2, 64, 16, None, False, 1),  # decode, MHA
    (3, 1, 4, 2, 128, 16, None, True, 1),  # decode, GQA 4, a padded slot
    (2, 1, 8, 1, 64, 32, None, False, 4),  # decode, split-K
    (2, 4, 8, 1, 64, 16, 4, True, 1),  # verify a 4-node tree
    (2, 7, 4, 2, 64, 32, 7, False, 2),  # verify 7 nodes, split-K
    (2, 16, 8, 1, 128, 16, 16, True, 1),  # verify 16 nodes, GQA 8, D 128 (128 rows per program)
    (2, 5, 4, 1, 64, 16, 9, False, 1),  # multi-step draft: 5 new nodes see 4 older tree nodes
    (2, 3, 5, 1, 64, 16, 3, False, 1),  # group 5 (not a power of two)
    (2, 16, 1, 2, 64, 16, None, True, 1),  # causal extension, q_len 16
    (1, 40, 8, 1, 64, 16, None, False, 2),  # prefill-like width: three query tiles, causal skip
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "b{}-q{}-g{}-h{}-d{}-p{}-w{}-pad{}-s{}".format(*c))
def test_paged_attention_matches_torch_backend(case):
    batch, q_len, group, hkv, head_dim, page_size, width, pad, splits = case
    c = attention_case(batch, q_len, group, hkv, head_dim, page_size, torch.float32, DEVICE,
                       seed=ATTENTION_CASES.index(case), mask_width=width, pad_last=pad)
    out = torch.full_like(c["q"], float("nan"))
    paged_attention(c["q"], c["k_pool"], c["v_pool"], c["block_tables"], c["kv_lens"], c["scale"],
                    mask=c["mask"], out=out, num_splits=splits)
    assert not out.isnan().any(), "an output element was not written, or a padded row made NaN"
    assert norm_rel_err(out[: c["t_real"]], c["ref"]) < 1e-5


@pytest.mark.parametrize("q_len,width,splits", [(1, None, 4), (1, None, 8), (4, 6, 4)])
def test_paged_attention_split_k_long_context(q_len, width, splits):
    c = attention_case(2, q_len, 4, 1, 64, 16, torch.float32, DEVICE, seed=splits + q_len, mask_width=width,
                       max_prefix=420)
    out = torch.full_like(c["q"], float("nan"))
    paged_attention(c["q"], c["k_pool"], c["v_pool"], c["block_tables"], c["kv_lens"], c["scale"],
                    mask=c["mask"], out=out, num_splits=splits)
    assert norm_rel_err(out, c["ref"]) < 1e-5


def test_paged_attention_bf16_and_default_splits():
    c = attention_case(2, 4, 4, 2, 64, 16, torch.bfloat16, DEVICE, seed=7, mask_width=4)
    out = paged_attention(c["q"], c["k_pool"], c["v_pool"], c["block_tables"], c["kv_lens"], c["scale"], mask=c["mask"])
    assert out.dtype == torch.bfloat16 and norm_rel_err(out, c["ref"]) < 1e-2


def test_paged_attention_rejects_bad_shapes():
    c = attention_case(2, 2, 2, 1, 64, 16, torch.float32, DEVICE, seed=3)
    with pytest.raises(ValueError):  # 4 rows do not split into 3 sequences
        paged_attention(c["q"], c["k_pool"], c["v_pool"], c["block_tables"][:1].repeat(3, 1),
                        c["kv_lens"][:1].repeat(3), c["scale"])
    with pytest.raises(ValueError):  # mask narrower than q_len
        paged_attention(c["q"], c["k_pool"], c["v_pool"], c["block_tables"], c["kv_lens"], c["scale"],
                        mask=torch.ones(2, 2, 1, dtype=torch.bool, device=DEVICE))


# ---------------------------------------------------------------- rotary + KV store
def _qkv_views(tokens, hq, hkv, head_dim, dtype, gen):
    """q, k, v as the strided views a fused QKV projection produces."""
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, generator=gen).to(device=DEVICE, dtype=dtype)
    q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    return q.view(tokens, hq, head_dim), k.view(tokens, hkv, head_dim), v.view(tokens, hkv, head_dim)


@pytest.mark.parametrize("dtype,head_dim,hq,hkv", [(torch.float32, 64, 4, 2), (torch.float32, 128, 6, 3),
                                                   (torch.bfloat16, 64, 8, 1)])
def test_rotary_and_store(dtype, head_dim, hq, hkv):
    gen = torch.Generator().manual_seed(head_dim + hq)
    tokens, page_size, num_pages = 9, 16, 6
    q, k, v = _qkv_views(tokens, hq, hkv, head_dim, dtype, gen)
    cos, sin = rotary_tables(100, head_dim, DEVICE)
    positions = torch.randint(0, 100, (tokens,), generator=gen).to(DEVICE)
    positions[3] = positions[4]  # tree nodes share positions
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens].to(DEVICE)
    k_pool = torch.randn(num_pages, page_size, hkv, head_dim, generator=gen).to(device=DEVICE, dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    want_q, want_k = rotary_reference(q, k, cos, sin, positions)
    want_kp, want_vp = k_pool.clone(), v_pool.clone()
    want_kp.view(-1, hkv, head_dim)[slots] = want_k
    want_vp.view(-1, hkv, head_dim)[slots] = v
    q_in = q.clone()
    k_out = torch.full_like(k, float("nan"))
    got = rotary_and_store(q, k, v, cos, sin, positions, k_pool, v_pool, slots, k_out=k_out)
    assert got is q  # in place
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert norm_rel_err(q, want_q) < tol and norm_rel_err(k_out, want_k) < tol
    assert norm_rel_err(k_pool, want_kp) < tol and torch.equal(v_pool, want_vp)
    # out of place, and a negative slot leaves the pools alone
    q_out = torch.full_like(q_in, float("nan"))
    slots[0] = -1
    before = k_pool.clone()
    rotary_and_store(q_in, k, v, cos, sin, positions, k_pool, v_pool, slots, q_out=q_out)
    assert norm_rel_err(q_out, want_q) < tol
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[1:]] = False
    assert torch.equal(k_pool.view(-1, hkv, head_dim)[untouched], before.view(-1, hkv, head_dim)[untouched])


def test_rotary_and_store_reads_positions_and_slots_through_their_strides():
    """One request's tree nodes share a position: the draft expands it (stride 0). Reading such a tensor
    as contiguous ran past it (the draft graphs' illegal memory access at batch 1)."""
    gen = torch.Generator().manual_seed(5)
    tokens, hkv, head_dim = 2, 2, 64
    q, k, v = _qkv_views(tokens, 4, hkv, head_dim, torch.float32, gen)
    cos, sin = rotary_tables(100, head_dim, DEVICE)
    base = torch.tensor([7, 93], device=DEVICE)
    positions = base[:1].expand(tokens)  # [7, 7] with stride 0; the memory after it holds 93
    slot_base = torch.tensor([[5, 70], [21, 40]], device=DEVICE)
    slots = slot_base[:, 0]  # [5, 21] with stride 2 (a column)
    assert positions.stride(0) == 0 and slots.stride(0) == 2
    k_pool = torch.zeros(6, 16, hkv, head_dim, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    want_q, want_k = rotary_reference(q, k, cos, sin, positions.contiguous())
    q_out = torch.empty_like(q)
    rotary_and_store(q, k, v, cos, sin, positions, k_pool, v_pool, slots, q_out=q_out)
    assert norm_rel_err(q_out, want_q) < 1e-5
    assert norm_rel_err(k_pool.view(-1, hkv, head_dim)[[5, 21]], want_k) < 1e-5
    assert torch.equal(v_pool.view(-1, hkv, head_dim)[[5, 21]], v)
    store_kv(k, v, k_pool, v_pool, slot_base[:, 1])  # a strided column again: slots 70 and 40
    assert torch.equal(v_pool.view(-1, hkv, head_dim)[[70, 40]], v)


def test_store_kv():
    gen = torch.Generator().manual_seed(11)
    _, k, v = _qkv_views(5, 4, 2, 64, torch.float32, gen)
    k_pool = torch.randn(4, 16, 2, 64, generator=gen).to(DEVICE)
    v_pool = torch.randn_like(k_pool)
    slots = torch.tensor([17, 3, 40, 63, 0], device=DEVICE)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    want_k.view(-1, 2, 64)[slots] = k
    want_v.view(-1, 2, 64)[slots] = v
    store_kv(k, v, k_pool, v_pool, slots)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)


# ---------------------------------------------------------------- RMSNorm and SwiGLU
@pytest.mark.parametrize("dtype,size", [(torch.float32, 96), (torch.float32, 512), (torch.bfloat16, 320)])
def test_rms_norm(dtype, size):
    gen = torch.Generator().manual_seed(size)
    x = torch.randn(7, size, generator=gen).to(device=DEVICE, dtype=dtype)
    res = torch.randn(7, size, generator=gen).to(device=DEVICE, dtype=dtype)
    w = (1 + 0.1 * torch.randn(size, generator=gen)).to(device=DEVICE, dtype=dtype)
    # bf16: the interpreter rounds float32 -> bf16 toward zero (the GPU rounds to nearest, and the GPU
    # test asks for h bit-exact), so h is off by up to an ulp here.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    out = torch.full_like(x, float("nan"))
    assert rms_norm(x, w, 1e-6, out=out) is out
    assert norm_rel_err(out, rms_norm_reference(x, w, 1e-6)) < tol
    normed, h = rms_norm(x, w, 1e-5, residual=res)
    want_h = x + res
    assert norm_rel_err(h, want_h) < tol and norm_rel_err(normed, rms_norm_reference(want_h, w, 1e-5)) < tol
    # in place, as the decoder layer would run it: h overwrites the residual, the norm overwrites x
    want = rms_norm_reference(want_h, w, 1e-5)
    normed, h = rms_norm(x, w, 1e-5, residual=res, out=x, residual_out=res)
    assert normed is x and h is res and norm_rel_err(h, want_h) < tol and norm_rel_err(x, want) < tol


def test_rms_norm_per_head_on_strided_view():
    gen = torch.Generator().manual_seed(5)
    q, k, _ = _qkv_views(6, 4, 2, 64, torch.float32, gen)  # Qwen3 q/k norm runs on these views
    w = torch.randn(64, generator=gen).to(DEVICE)
    out = rms_norm(q, w, 1e-6)
    assert out.shape == q.shape and norm_rel_err(out, rms_norm_reference(q, w, 1e-6)) < 1e-5
    assert norm_rel_err(rms_norm(k, w, 1e-6), rms_norm_reference(k, w, 1e-6)) < 1e-5


@pytest.mark.parametrize("dtype,inter", [(torch.float32, 1000), (torch.float32, 1500), (torch.bfloat16, 384)])
def test_silu_and_mul(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (2 * torch.randn(5, 2 * inter, generator=gen)).to(device=DEVICE, dtype=dtype)
    out = torch.full((5, inter), float("nan"), dtype=dtype, device=DEVICE)
    silu_and_mul(gate_up, out=out)
    assert norm_rel_err(out, silu_and_mul_reference(gate_up)) < (1e-5 if dtype == torch.float32 else 1e-2)


# ---------------------------------------------------------------- skinny matmuls
@pytest.mark.parametrize("kernel", ["rows", "dot"])
@pytest.mark.parametrize("rows,n,k,bias", [(1, 40, 256, False), (1, 37, 200, True), (2, 40, 128, False), (3, 64, 96, True),
                                           (4, 33, 256, True), (16, 24, 128, False)])
def test_gemv_matches_linear(kernel, rows, n, k, bias):
    """Odd N (the last block re-reads valid rows, stores masked), K not a multiple of the tile, 1..16
    rows, a strided x, with and without bias; the output is poisoned first."""
    from tandem.kernels.gemv import GemvConfig, gemv

    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k + 8, generator=gen)[:, :k].to(DEVICE)  # row stride k + 8
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    b = torch.randn(n, generator=gen).to(DEVICE) if bias else None
    out = torch.full((rows, n), float("nan"), device=DEVICE)
    cfg = GemvConfig(kernel, block_n=16 if kernel == "dot" else 8, block_k=64)
    gemv(x, w, b, config=cfg, out=out)
    assert norm_rel_err(out, F.linear(x, w, b)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_router_logits_equal_a_float32_linear_of_the_upcast_rows(dtype, rows):
    """The MoE router's logits: rows of any dtype against a float32 weight, in float32 — what
    ``linear(x.float(), W)`` gives (float64 reference: the sums' order differs)."""
    from tandem.kernels.gemv import router_logits

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(24, 200, generator=gen).to(DEVICE)
    out = router_logits(x, w)
    assert out.dtype == torch.float32 and out.shape == (rows, 24)
    ref = F.linear(x.double(), w.double())
    assert (out.double() - ref).abs().max() < 1e-5 * ref.abs().max()


@pytest.mark.parametrize("folded", [True, False], ids=["read-by-the-gemv", "computed-first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k", [(1, 256), (1, 200), (3, 128)])
def test_gemv_reads_silu_of_gate_times_up_with_swiglu(dtype, rows, k, folded, monkeypatch):
    """x = [gate | up] rows: the product is with silu(gate) * up, rounded as torch's two ops round (float64 after);
    read by the GEMV, or (beyond activation.SWIGLU_FOLD_MAX recomputed activations) computed first."""
    from tandem.kernels import activation, gemv as gemv_module
    from tandem.kernels.gemv import GemvConfig, gemv

    calls = []
    monkeypatch.setattr(gemv_module, "silu_and_mul", lambda x: calls.append(1) or activation.silu_and_mul(x))
    if not folded:
        monkeypatch.setattr(activation, "SWIGLU_FOLD_MAX", 0)

    gen = torch.Generator().manual_seed(rows * 7 + k)
    gate_up = torch.randn(rows, 2 * k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(40, k, generator=gen) * 0.1).to(dtype).to(DEVICE)
    y = gemv(gate_up, w, config=GemvConfig("rows", block_n=8, block_k=64), swiglu=True)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up  # (in dtype: the silu rounded, then the product)
    assert norm_rel_err(y, F.linear(act.double(), w.double())) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert len(calls) == (0 if folded else 1)
    with pytest.raises(ValueError, match="rows"):
        gemv(gate_up, w, config=GemvConfig("dot", block_n=16, block_k=64), swiglu=True)


def test_swiglu_is_read_by_the_gemv_only_where_its_recomputation_is_small():
    """Each program of a SwiGLU-reading GEMV recomputes the activations: the 8B shape's down projections (bf16:
    1024 programs of 4 rows, INT4: 512 of 8, over 14336 columns) and Kimi's experts at batch 1 (896 programs x 8
    slots x 2048) compute them first; DeepSeek-V2-Lite's experts at batch 1 (256 programs x 6 slots x 1408) read them."""
    from tandem.kernels.activation import fold_swiglu

    assert not fold_swiglu(1024 * 14336) and not fold_swiglu(512 * 14336) and not fold_swiglu(896 * 8 * 2048)
    assert fold_swiglu(256 * 6 * 1408)


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("k,steps", [(256, 4), (256, 2), (200, 4), (96, 8)])
def test_gemv_reading_several_weight_tiles_before_the_wait_matches_linear(k, steps, swiglu):
    """``prefetch_steps``: the first tiles read ahead (all of K, part of it, a ragged last tile, more steps than K
    holds); the same product as F.linear, in float32."""
    from tandem.kernels.gemv import GemvConfig, gemv

    gen = torch.Generator().manual_seed(k + steps)
    x = torch.randn(1, (2 if swiglu else 1) * k, generator=gen).to(DEVICE)
    w = torch.randn(40, k, generator=gen).to(DEVICE)
    y = gemv(x, w, config=GemvConfig("rows", block_n=8, block_k=64, prefetch_steps=steps), swiglu=swiglu)
    act = F.silu(x[:, :k]) * x[:, k:] if swiglu else x
    assert norm_rel_err(y, F.linear(act.double(), w.double())) < 1e-6
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, k), w.cpu(), config=GemvConfig("rows", block_n=8, block_k=64, prefetch_steps=steps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,block_k,steps,normed_out", [(256, 64, 1, True), (200, 64, 1, False), (256, 64, 3, True),
                                                         (96, 128, 1, True)])
def test_gemv_applies_its_input_norm_as_the_norm_kernel_rounds_it(dtype, k, block_k, steps, normed_out):
    """``norm=``: the product with RMSNorm(x + residual) (RMSNorm's formula after the model's add, float64 after it),
    the residual stream written once, and the normalised row where asked — equal to the norm kernel's output bit for
    bit in float32 and to an ulp in bf16 (the mean square sums in another order); K ragged, shorter than one step, or
    read partly before the wait; outputs poisoned first."""
    from tandem.kernels.gemv import GemvConfig, InputNorm, gemv
    from tandem.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(k + block_k + steps)
    x, res = (torch.randn(1, k, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    g = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(DEVICE)
    w = (torch.randn(40, k, generator=gen) * 0.1).to(dtype).to(DEVICE)
    stream, normed = (torch.full((1, k), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    cfg = GemvConfig("rows", block_n=8, block_k=block_k, prefetch_steps=steps)
    y = gemv(x, w, config=cfg, norm=InputNorm(res, g, 1e-6, stream, normed if normed_out else None))
    ref = RMSNorm(k, 1e-6).to(dtype).to(DEVICE)
    ref.weight.data = g
    want_x, want_stream = ref(x, res)
    assert torch.equal(stream, want_stream)
    assert norm_rel_err(y, F.linear(want_x.double(), w.double())) < (1e-6 if dtype == torch.float32 else 1e-2)
    if normed_out:
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22
        assert ((normed.float() - want_x.float()).abs() <= ulp * want_x.float().abs()).all()
        kernel_x, _ = rms_norm(x, g, 1e-6, residual=res)
        if dtype == torch.float32:
            assert torch.allclose(normed, kernel_x, rtol=2.0 ** -22, atol=0)
    else:
        assert normed.isnan().all()
    with pytest.raises(ValueError, match="one contiguous row"):
        gemv(x.expand(2, k), w, config=GemvConfig("rows", block_n=8, block_k=64), norm=InputNorm(res, g, 1e-6, stream))
    with pytest.raises(ValueError, match="'rows' kernel only"):
        gemv(x, w, config=GemvConfig("dot", block_n=16, block_k=64), norm=InputNorm(res, g, 1e-6, stream))


def test_gemv_rejects_bad_shapes():
    from tandem.kernels.gemv import GemvConfig, gemv

    with pytest.raises(ValueError, match="rows"):
        gemv(torch.zeros(17, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        gemv(torch.zeros(1, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="kernel"):
        GemvConfig("tensorcore")


def test_gemv_routes_from_env(tmp_path, monkeypatch):
    """TANDEM_GEMV_ROUTES: unset, the defaults; a file, its routes only (rows 4 where it names none);
    "none", no route; a malformed file, an error naming the variable. A CPU tensor never routes:
    matmul's CPU path is F.linear whatever the table says."""
    import json as _json

    from tandem.layers import gemv_routes
    from tandem.layers.linear import matmul

    cfg = {"kernel": "dot", "block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 3}
    routes = tmp_path / "routes.json"
    routes.write_text(_json.dumps([{"n": 24, "k": 64, "config": cfg}, {"rows": 2, "n": 8, "k": 64, "config": cfg}]))
    monkeypatch.delenv("TANDEM_GEMV_ROUTES", raising=False)
    assert gemv_routes._from_env() == gemv_routes.DEFAULT_ROUTES
    monkeypatch.setenv("TANDEM_GEMV_ROUTES", str(routes))
    assert gemv_routes._from_env() == {(4, 24, 64): cfg, (2, 8, 64): cfg}
    monkeypatch.setenv("TANDEM_GEMV_ROUTES", "none")
    assert gemv_routes._from_env() == {}
    for bad in ("{not json", '[{"n": 24, "config": {}}]', '[{"rows": 1, "n": 24, "k": 64, "config": {}}]'):
        routes.write_text(bad)
        monkeypatch.setenv("TANDEM_GEMV_ROUTES", str(routes))
        with pytest.raises(ValueError, match="TANDEM_GEMV_ROUTES="):
            gemv_routes._from_env()
    before = gemv_routes.current_routes()
    gemv_routes.set_routes({(4, 24, 64): {"kernel": "no-such-kernel"}})
    try:
        assert gemv_routes.route(4, 24, 64) == {"kernel": "no-such-kernel"}
        assert gemv_routes.route(3, 24, 64) is None and gemv_routes.route(4, 64, 24) is None
        x, w = torch.randn(4, 64), torch.randn(24, 64)
        assert torch.equal(matmul(x, w), F.linear(x, w))  # the bogus route was never built on the CPU
    finally:
        gemv_routes.set_routes(before)


# ---------------------------------------------------------------- the compiled path
def test_kernels_compile_for_hopper_without_spills():
    """The interpreter never compiles; this builds every kernel for sm_90 (no GPU needed) and fails on
    a compile error or a register spill. See tandem/kernels/compile_check.py."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton wheel has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    # The compile is single-threaded: a process per free core (CI has two), each compiling every other kernel; under
    # pytest-xdist the other cores run the other workers, and one process compiles each distinct kernel only once.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    n = max(1, min(2, (os.cpu_count() or 1) // workers))
    # Spills and registers come from every kernel's resource usage; only the attention kernels are disassembled (the
    # matrix instruction asserted below; the SASS of the others, ~0.4 s a kernel, only feeds printed load counts).
    parts = [subprocess.Popen([sys.executable, "-m", "tandem.kernels.compile_check", "bfloat16", f"{i}/{n}",
                               "--sass", "attention"], cwd=root,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    outputs = [p.communicate(timeout=400) for p in parts]
    for p, (out, err) in zip(parts, outputs):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
    assert "HGMMA" in "".join(out for out, _ in outputs)  # wide query tiles reach Hopper's wgmma
