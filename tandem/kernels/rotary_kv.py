"""Rotary embedding on q and k fused with the store of k and v into the paged pool: one launch per layer
instead of the gather of cos/sin, the casts, the two rotate_half concatenations and the two
index_copy calls of the reference path.

The rotation is Hugging Face's rotate_half form: with x = [x1, x2] (halves of the head),
``out = [x1*cos1 - x2*sin1, x2*cos2 + x1*sin2]`` where cos/sin are rows of the float32 tables
(``[max_pos, D]``, the two halves equal for HF tables, read separately anyway so any table works).
Arithmetic is in float32 with one rounding at the end.

One program per token handles all its heads: q, k and v are usually strided views of one fused QKV
projection output, so the rows are read where they lie, with no ``.contiguous()`` copies. Positions
and slots are read through their strides too: a batch of one request's expanded positions has
stride 0 (reading them as contiguous ran past the tensor: the illegal memory access of the draft
graphs' tree capture at batch 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _rotate(ptr, row_off, heads, stride_h, c1, s1, c2, s2,
            BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Load [heads, D] at ptr+row_off as two halves, rotate in float32; returns (x1', x2', row mask)."""
    h = tl.arange(0, BLOCK_H)
    dh = tl.arange(0, HALF)
    off = row_off + h[:, None] * stride_h + dh[None, :]
    ok = (h < heads)[:, None]
    x1 = tl.load(ptr + off, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + off + HALF, mask=ok, other=0.0).to(tl.float32)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, ok


@triton.jit
def _rotary_store_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_pool_ptr, v_pool_ptr,
    num_q_heads, num_kv_heads, stride_pos, stride_slot,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos, stride_sin,
    stride_kp, stride_kps, stride_kph, stride_vp, stride_vps, stride_vph,
    PAGE_SIZE: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    WRITE_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
    dh = tl.arange(0, HALF)
    c1 = tl.load(cos_ptr + pos * stride_cos + dh)[None, :]
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + dh)[None, :]
    s1 = tl.load(sin_ptr + pos * stride_sin + dh)[None, :]
    s2 = tl.load(sin_ptr + pos * stride_sin + HALF + dh)[None, :]

    q1, q2, q_ok = _rotate(q_ptr, t * stride_qt, num_q_heads, stride_qh, c1, s1, c2, s2, BLOCK_HQ, HALF)
    hq = tl.arange(0, BLOCK_HQ)
    q_off = t * stride_qot + hq[:, None] * stride_qoh + dh[None, :]
    tl.store(q_out_ptr + q_off, q1.to(q_out_ptr.dtype.element_ty), mask=q_ok)
    tl.store(q_out_ptr + q_off + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=q_ok)

    k1, k2, k_ok = _rotate(k_ptr, t * stride_kt, num_kv_heads, stride_kh, c1, s1, c2, s2, BLOCK_HKV, HALF)
    hk = tl.arange(0, BLOCK_HKV)
    if WRITE_K:
        k_off = t * stride_kot + hk[:, None] * stride_koh + dh[None, :]
        tl.store(k_out_ptr + k_off, k1.to(k_out_ptr.dtype.element_ty), mask=k_ok)
        tl.store(k_out_ptr + k_off + HALF, k2.to(k_out_ptr.dtype.element_ty), mask=k_ok)

    # A negative slot means "do not store" (padding that has no dummy slot).
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    store_ok = k_ok & (slot >= 0)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    kp_off = page * stride_kp + offset * stride_kps + hk[:, None] * stride_kph + dh[None, :]
    tl.store(k_pool_ptr + kp_off, k1.to(k_pool_ptr.dtype.element_ty), mask=store_ok)
    tl.store(k_pool_ptr + kp_off + HALF, k2.to(k_pool_ptr.dtype.element_ty), mask=store_ok)
    d = tl.arange(0, 2 * HALF)
    v = tl.load(v_ptr + t * stride_vt + hk[:, None] * stride_vh + d[None, :], mask=k_ok, other=0.0)
    vp_off = page * stride_vp + offset * stride_vps + hk[:, None] * stride_vph + d[None, :]
    tl.store(v_pool_ptr + vp_off, v.to(v_pool_ptr.dtype.element_ty), mask=store_ok)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, slot_ptr, k_pool_ptr, v_pool_ptr, num_kv_heads, stride_slot,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kp, stride_kps, stride_kph, stride_vp, stride_vps, stride_vph,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HKV: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_HKV)
    d = tl.arange(0, HEAD_DIM)
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    ok = (h < num_kv_heads)[:, None] & (slot >= 0)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok, other=0.0)
    kp_off = page * stride_kp + offset * stride_kps + h[:, None] * stride_kph + d[None, :]
    vp_off = page * stride_vp + offset * stride_vps + h[:, None] * stride_vph + d[None, :]
    tl.store(k_pool_ptr + kp_off, k.to(k_pool_ptr.dtype.element_ty), mask=ok)
    tl.store(v_pool_ptr + vp_off, v.to(v_pool_ptr.dtype.element_ty), mask=ok)


def _check_kv(k, v, k_pool, v_pool) -> None:
    head_dim = k.shape[-1]
    if head_dim & (head_dim - 1) or v.shape != k.shape or k_pool.shape[2:] != k.shape[1:] or v_pool.shape != k_pool.shape:
        raise ValueError(f"pool {tuple(k_pool.shape)} does not hold k {tuple(k.shape)} / v {tuple(v.shape)}")
    for name, x in (("k", k), ("v", v), ("k_pool", k_pool), ("v_pool", v_pool)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes k, v ``[T, Hkv, D]`` (already rotated) into the pools at ``slot_mapping`` (negative = skip)."""
    _check_kv(k, v, k_pool, v_pool)
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](
        k, v, slot_mapping, k_pool, v_pool, k.shape[1], slot_mapping.stride(0),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        PAGE_SIZE=k_pool.shape[1], HEAD_DIM=k.shape[2], BLOCK_HKV=triton.next_power_of_2(k.shape[1]),
        num_warps=4, **pdl_launch(k),
    )


def rotary_and_store(
    q: torch.Tensor,  # [T, Hq, D]; may be a strided view (last dim contiguous)
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # float32 [max_pos, D] (RotaryEmbedding.cos)
    sin: torch.Tensor,  # float32 [max_pos, D] (RotaryEmbedding.sin)
    positions: torch.Tensor,  # int32/int64 [T]
    k_pool: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]: page * page_size + offset; negative = skip
    q_out: torch.Tensor | None = None,  # None: rotate q in place
    k_out: torch.Tensor | None = None,  # where to also write the rotated k (None: pool only)
) -> torch.Tensor:
    """Rotates q (into ``q_out``, default in place) and k, stores rotated k and v at the slots; returns q_out."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _check_kv(k, v, k_pool, v_pool)
    if k.shape[2] != head_dim or head_dim < 2 or cos.shape[1] != head_dim or sin.shape != cos.shape:
        raise ValueError(f"head dims differ: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}")
    for name, x in (("q", q), ("cos", cos), ("sin", sin)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    q_out = q if q_out is None else q_out
    k_dst = k_out if k_out is not None else k
    if num_tokens == 0:
        return q_out
    _rotary_store_kernel[(num_tokens,)](
        q, k, v, q_out, k_dst, cos, sin, positions, slot_mapping, k_pool, v_pool,
        num_q_heads, num_kv_heads, positions.stride(0), slot_mapping.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_dst.stride(0), k_dst.stride(1), cos.stride(0), sin.stride(0),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        PAGE_SIZE=k_pool.shape[1], HALF=head_dim // 2,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        WRITE_K=k_out is not None, num_warps=4, **pdl_launch(q),
    )
    return q_out
