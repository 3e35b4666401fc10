"""MLA's absorbed projections for a few query rows (decode, chains, small trees): ``W_UK`` folded into the
query before the latent attention and ``W_UV`` applied to its result.

The reference (MLAttention.forward on the torch backend) writes them as two batched einsums and a
concatenation; at batch 1 those are a handful of cuBLAS and copy kernels outside the chain of
PDL-launched kernels around them. Here each is one launch:

* ``absorb_q(q, w_uk, kv_lora)`` → ``[T, H, kv_lora + rope]``: ``q_nope[t, h] @ w_uk[h]`` in the first
  kv_lora columns and ``q_pe[t, h]`` copied behind them — what the latent attention reads.
* ``absorb_out(attended, w_uv)`` → ``[T, H, v]``: ``attended[t, h] @ w_uv[h]ᵀ``; ``attended`` may be the latent
  attention's splits unmerged (``LatentSplits``): each program then merges its head's splits as it reads them,
  exactly as the merge kernel would (the same float32 sums, rounded to the activation dtype), which spares a
  dependent kernel a layer but merges a head's splits once per program of that head. Off by default
  (``MERGE_SPLITS_HERE``) until it measures faster (docs/benchmarks.md, the V2-Lite profile);
  ``bench/profile_deepseek.py --absorb-merge N`` tries it with about N programs a head.

At a few rows the weights (slices of the kv_b projection) are nearly all the bytes read, so the grid is
split over heads × column tiles (absorb_q) or heads × value rows (absorb_out) until it has ~256 programs.
Each program loads its weight tile before ``pdl_enter`` (no earlier kernel writes the weights, so the load
overlaps the previous kernel's tail), then walks the token rows with the tile held in registers. The
products are elementwise and summed in float32 (no ``tl.dot``: the shapes are skinny, and the interpreter's
dot reads bf16 as integers), then rounded once to the activation dtype as cuBLAS rounds its result; the
summation order differs from cuBLAS, so bf16 results may differ from the einsums by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.mla_attention import LatentSplits
from tandem.kernels.mla_prologue import Prologue, _latent_entry, _pair_offsets, _rope_tables, _rotate, prologue_shapes
from tandem.kernels.paged_attention import _NO_KEY
from tandem.kernels.pdl import pdl_enter, pdl_launch
from tandem.kernels.rounding import round_to

# Above this the model keeps the einsums: each program walks its rows one after another, and at 8 rows the kernels
# took about as long as the einsums with their cat and copies on the H200 (bench --sections mla, absorb rows).
MAX_ROWS = 8
PROGRAMS_WANTED = 256  # enough programs in flight to stream the weights on Hopper's 132 SMs
# absorb_q runs the layer's MLA prologue (tandem/kernels/mla_prologue.py) in its own launch, one more program beside
# the heads' (bench/profile_deepseek.py --prologue-apart: two launches)
PROLOGUE_IN_ABSORB_Q = True
MERGE_SPLITS_HERE = False  # the model hands absorb_out the latent attention's splits unmerged (see the module)
SPLIT_PROGRAMS_PER_HEAD = 4  # ... and each head's value rows are cut into about this many programs, each merging


@triton.jit
def _absorb_q_kernel(
    q_ptr, w_ptr, out_ptr, num_tokens, num_heads,
    stride_qt, stride_qh, stride_wh, stride_wn, stride_ot, stride_oh,
    kv_ptr, norm_w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, pool_ptr, eps,  # the prologue's (PROLOGUE)
    stride_pos, stride_slot, stride_kvt, stride_cos, stride_sin, stride_page, page_size,
    NOPE: tl.constexpr, ROPE: tl.constexpr, KV_LORA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr, COL_TILES: tl.constexpr, PROLOGUE: tl.constexpr, BLOCK_LORA: tl.constexpr,
    INTERLEAVE: tl.constexpr, PDL: tl.constexpr,
):
    """Programs ``h * COL_TILES + tile``: head h's absorbed query in that column tile (and, in tile 0, its rope
    dims behind: copied, or rotated where ``PROLOGUE``); with ``PROLOGUE`` one more program, the latent entries of
    every token (mla_prologue's ``_latent_entry``)."""
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    if pid < num_heads * COL_TILES:
        h = (pid // COL_TILES).to(tl.int64)
        c = (pid % COL_TILES) * BLOCK_C + tl.arange(0, BLOCK_C)
        n = tl.arange(0, BLOCK_N)
        c_ok, n_ok = c < KV_LORA, n < NOPE
        # the weights are no earlier kernel's output: read them while it finishes
        w = tl.load(w_ptr + h * stride_wh + n[:, None] * stride_wn + c[None, :], mask=n_ok[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
        pdl_enter(PDL)
        r = tl.arange(0, BLOCK_R)
        copies_pe = pid % COL_TILES == 0  # one column tile per head writes the rope dims
        q_row, out_row = q_ptr + h * stride_qh, out_ptr + h * stride_oh
        t = 0
        while t < num_tokens:
            x = tl.load(q_row + n, mask=n_ok, other=0.0).to(tl.float32)
            acc = tl.sum(x[:, None] * w, axis=0)
            tl.store(out_row + c, round_to(acc, dtype).to(dtype), mask=c_ok)
            if copies_pe:
                if PROLOGUE:  # rotated here, as the prologue kernel rotates q in place
                    first, second = _pair_offsets(ROPE // 2, INTERLEAVE)
                    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
                    cos, sin = _rope_tables(cos_ptr, sin_ptr, pos, stride_cos, stride_sin, ROPE // 2, dtype)
                    pe1, pe2 = _rotate(tl.load(q_row + NOPE + first).to(tl.float32),
                                       tl.load(q_row + NOPE + second).to(tl.float32), cos, sin, dtype)
                    tl.store(out_row + KV_LORA + first, pe1)
                    tl.store(out_row + KV_LORA + second, pe2)
                else:
                    pe = tl.load(q_row + NOPE + r, mask=r < ROPE)
                    tl.store(out_row + KV_LORA + r, pe, mask=r < ROPE)
            q_row += stride_qt
            out_row += stride_ot
            t += 1
    elif PROLOGUE:
        pdl_enter(PDL)
        t = 0
        while t < num_tokens:
            pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
            cos, sin = _rope_tables(cos_ptr, sin_ptr, pos, stride_cos, stride_sin, ROPE // 2, dtype)
            slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
            _latent_entry(kv_ptr + t * stride_kvt, norm_w_ptr, cos, sin, slot, pool_ptr, eps, stride_page, page_size,
                          KV_LORA, BLOCK_LORA, ROPE // 2, INTERLEAVE)
            t += 1


@triton.jit
def _merged_row(o_row, lse_row, c, c_ok, stride_os, stride_ls, NUM_SPLITS: tl.constexpr, dtype: tl.constexpr):
    """One token's and head's latent output from its splits, as paged_attention's merge kernel computes and rounds
    it (the splits weighted by their log-sum-exps; a split that saw no key wrote nothing and is not read)."""
    s = tl.arange(0, NUM_SPLITS)
    lse = tl.load(lse_row + s * stride_ls)
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(o_row + s[:, None] * stride_os + c[None, :], mask=(lse > _NO_KEY)[:, None] & c_ok[None, :], other=0.0)
    merged = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    return merged.to(dtype).to(tl.float32)


@triton.jit
def _absorb_out_kernel(
    a_ptr, lse_ptr, w_ptr, out_ptr, num_tokens,
    stride_as, stride_at, stride_ah, stride_ls, stride_lt, stride_wh, stride_wv, stride_ot, stride_oh,
    V: tl.constexpr, KV_LORA: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    c = tl.arange(0, BLOCK_C)
    v_ok, c_ok = v < V, c < KV_LORA
    w = tl.load(w_ptr + h * stride_wh + v[:, None] * stride_wv + c[None, :], mask=v_ok[:, None] & c_ok[None, :],
                other=0.0).to(tl.float32)  # before the wait, as in absorb_q
    pdl_enter(PDL)
    dtype = out_ptr.dtype.element_ty
    a_row, lse_row, out_row = a_ptr + h * stride_ah, lse_ptr + h, out_ptr + h * stride_oh
    t = 0
    while t < num_tokens:
        if NUM_SPLITS == 1:
            a = tl.load(a_row + c, mask=c_ok, other=0.0).to(tl.float32)
        else:
            a = _merged_row(a_row, lse_row, c, c_ok, stride_as, stride_ls, NUM_SPLITS, dtype)
        acc = tl.sum(w * a[None, :], axis=1)
        tl.store(out_row + v, round_to(acc, dtype).to(dtype), mask=v_ok)
        a_row += stride_at
        lse_row += stride_lt
        out_row += stride_ot
        t += 1


def _tile(heads: int, cols: int, widest: int, narrowest: int) -> int:
    """The widest power-of-two tile (``narrowest`` .. ``widest``) that still gives ~PROGRAMS_WANTED programs."""
    block = min(widest, triton.next_power_of_2(cols))
    while block > narrowest and heads * triton.cdiv(cols, block) < PROGRAMS_WANTED:
        block //= 2
    return block


def _check(name: str, x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dtype != w.dtype:
        raise ValueError(f"{name}: activations {x.dtype} and weights {w.dtype} differ")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"{name} needs contiguous last dimensions")


def absorb_q(q: torch.Tensor, w_uk: torch.Tensor, kv_lora: int, prologue: Prologue | None = None) -> torch.Tensor:
    """``q`` [T, H, nope + rope] (any strides but the last), ``w_uk`` [H, nope, kv_lora] (a view of kv_b's
    weight) → ``[q_nope @ w_uk, q_pe]`` [T, H, kv_lora + rope], contiguous, in q's dtype. With ``prologue``, the
    layer's MLA prologue in the same launch (one dependent kernel fewer a layer): ``q_pe`` rotated on its way out
    (``q`` itself is left as it is) and the latent entries normalised, rotated and stored as ``mla_prologue(q,
    *prologue)`` does."""
    tokens, heads, head_dim = q.shape
    nope = w_uk.shape[1]
    if w_uk.shape != (heads, nope, kv_lora) or head_dim <= nope:
        raise ValueError(f"absorb_q: q {tuple(q.shape)} and w_uk {tuple(w_uk.shape)} (kv_lora {kv_lora}) "
                         f"do not agree")
    _check("absorb_q", q, w_uk)
    rope = head_dim - nope
    out = torch.empty(tokens, heads, kv_lora + rope, dtype=q.dtype, device=q.device)
    if prologue is not None and prologue_shapes(q, *prologue[:5], prologue.pool) != (kv_lora, rope // 2):
        raise ValueError(f"absorb_q: the prologue's latent is not kv_lora {kv_lora} + rope {rope}")
    if tokens == 0:
        return out
    block_c = _tile(heads, kv_lora, 64, 16)
    col_tiles = triton.cdiv(kv_lora, block_c)
    p = prologue if prologue is not None else Prologue(q, w_uk, 0.0, q, q, q, q, q, False)  # (unread)
    _absorb_q_kernel[(heads * col_tiles + (prologue is not None),)](
        q, w_uk, out, tokens, heads, q.stride(0), q.stride(1), w_uk.stride(0), w_uk.stride(1), out.stride(0),
        out.stride(1), p.kv_a, p.norm_weight, p.cos, p.sin, p.positions, p.slot_mapping, p.pool, p.eps,
        p.positions.stride(0), p.slot_mapping.stride(0), p.kv_a.stride(0), p.cos.stride(0), p.sin.stride(0),
        p.pool.stride(0), p.pool.shape[1] if prologue is not None else 1,
        NOPE=nope, ROPE=rope, KV_LORA=kv_lora, BLOCK_N=triton.next_power_of_2(nope),
        BLOCK_R=triton.next_power_of_2(rope), BLOCK_C=block_c, COL_TILES=col_tiles, PROLOGUE=prologue is not None,
        BLOCK_LORA=triton.next_power_of_2(kv_lora), INTERLEAVE=p.interleave, num_warps=4, **pdl_launch(q),
    )
    return out


def absorb_out(attended: "torch.Tensor | LatentSplits", w_uv: torch.Tensor) -> torch.Tensor:
    """``attended`` [T, H, kv_lora] (or the latent attention's unmerged splits of that, ``LatentSplits``), ``w_uv``
    [H, v, kv_lora] (a view of kv_b's weight) → ``attended @ w_uvᵀ`` per head [T, H, v], contiguous, in attended's
    dtype."""
    tokens, heads, kv_lora = attended.shape
    v = w_uv.shape[1]
    if w_uv.shape != (heads, v, kv_lora):
        raise ValueError(f"absorb_out: attended {tuple(attended.shape)} and w_uv {tuple(w_uv.shape)} do not agree")
    if isinstance(attended, LatentSplits):
        dtype, parts, lse = attended.dtype, attended.part_o, attended.part_lse
        if dtype != w_uv.dtype or parts.stride(-1) != 1 or w_uv.stride(-1) != 1:
            raise ValueError(f"absorb_out: splits for {dtype} (last stride {parts.stride(-1)}) and weights {w_uv.dtype} "
                             f"(last stride {w_uv.stride(-1)}) do not go together")
        splits, strides = parts.shape[0], (parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0),
                                           lse.stride(1))
    else:
        _check("absorb_out", attended, w_uv)
        dtype, parts, lse, splits = attended.dtype, attended, attended, 1
        strides = (0, attended.stride(0), attended.stride(1), 0, 0)
    out = torch.empty(tokens, heads, v, dtype=dtype, device=w_uv.device)
    if tokens == 0:
        return out
    block_v = (_tile(heads, v, 16, 4) if splits == 1 else
               max(4, triton.next_power_of_2(triton.cdiv(v, SPLIT_PROGRAMS_PER_HEAD))))
    _absorb_out_kernel[(heads, triton.cdiv(v, block_v))](
        parts, lse, w_uv, out, tokens, *strides, w_uv.stride(0), w_uv.stride(1), out.stride(0), out.stride(1),
        V=v, KV_LORA=kv_lora, BLOCK_V=block_v, BLOCK_C=triton.next_power_of_2(kv_lora), NUM_SPLITS=splits,
        num_warps=4, **pdl_launch(w_uv),
    )
    return out
