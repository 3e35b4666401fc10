"""MLA's prologue in one launch per layer: the kv_a RMSNorm of the latent, DeepSeek's rotary on the query's
and the key's rope dims, and the store of the latent entry ``[norm(c_kv), rotate(k_pe)]`` into the pool.

The reference path (MLAttention.forward with the torch backend) spends ~25 small kernels on this per layer
at batch 1 — a norm, per tensor a gather of cos and of sin, two casts, six products and sums and a stack, a
concatenation and an ``index_copy_`` — which at the DeepSeek-V2-Lite shape cost ~35 µs of a ~147 µs layer.

In place: the query's rope dims are rotated where they lie (``q`` [T, H, nope + rope], the q projection's
output), and the latent and key are written back into the kv_a projection's output ``kv_a`` [T, kv_lora +
rope], so the plain-prefill form reads them there. The rotation is YarnRotary's: pairs ``(x[2i], x[2i+1])``
when interleaved, else halves, by the float32 tables ``cos``/``sin`` [max_pos, rope / 2] (YaRN's attention
factor folded in). Both halves round as the reference does in the input dtype, so the kernel's route and the
torch route agree bit for bit on a GPU: the rotary casts cos and sin to it and rounds each product and the
sum; the norm rounds the normalised value, then its product with the weight. One program per token;
positions and slots are read through their strides; a negative slot skips the store (padding).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.kernels.pdl import pdl_enter, pdl_launch
from tandem.kernels.rounding import round_to


@triton.jit
def _pair_offsets(HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    i = tl.arange(0, HALF)
    if INTERLEAVE:
        return 2 * i, 2 * i + 1
    return i, i + HALF


@triton.jit
def _rotate(x1, x2, cos, sin, dtype: tl.constexpr):
    """YarnRotary in ``dtype``'s arithmetic: each product and the sum rounded, as torch does."""
    p1, p2 = round_to(x1 * cos, dtype), round_to(x2 * sin, dtype)
    p3, p4 = round_to(x2 * cos, dtype), round_to(x1 * sin, dtype)
    return round_to(p1 - p2, dtype).to(dtype), round_to(p3 + p4, dtype).to(dtype)


@triton.jit
def _rope_tables(cos_ptr, sin_ptr, pos, stride_cos, stride_sin, HALF: tl.constexpr, dtype: tl.constexpr):
    """Position ``pos``'s cos and sin [HALF], cast to ``dtype`` as the reference casts them."""
    i = tl.arange(0, HALF)
    return (round_to(tl.load(cos_ptr + pos * stride_cos + i), dtype),
            round_to(tl.load(sin_ptr + pos * stride_sin + i), dtype))


@triton.jit
def _latent_entry(kv_row, w_ptr, cos, sin, slot, pool_ptr, eps, stride_page, page_size, KV_LORA: tl.constexpr,
                  BLOCK_LORA: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """One token's latent entry: ``kv_row``'s latent normalised and its key's rope dims rotated, written back in
    place and, where ``slot`` is not negative, stored into the pool."""
    first, second = _pair_offsets(HALF, INTERLEAVE)
    c = tl.arange(0, BLOCK_LORA)
    c_ok = c < KV_LORA
    x = tl.load(kv_row + c, mask=c_ok, other=0.0)
    x32 = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x32 * x32, 0) / KV_LORA + eps)
    w = tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    latent = round_to(round_to(x32 * inv, x.dtype) * w, x.dtype).to(kv_row.dtype.element_ty)
    tl.store(kv_row + c, latent, mask=c_ok)

    k1 = tl.load(kv_row + KV_LORA + first).to(tl.float32)
    k2 = tl.load(kv_row + KV_LORA + second).to(tl.float32)
    k1, k2 = _rotate(k1, k2, cos, sin, kv_row.dtype.element_ty)
    tl.store(kv_row + KV_LORA + first, k1)
    tl.store(kv_row + KV_LORA + second, k2)

    if slot >= 0:
        entry = pool_ptr + (slot // page_size) * stride_page + (slot % page_size) * (KV_LORA + 2 * HALF)
        pool_ty = pool_ptr.dtype.element_ty
        tl.store(entry + c, latent.to(pool_ty), mask=c_ok)
        tl.store(entry + KV_LORA + first, k1.to(pool_ty))
        tl.store(entry + KV_LORA + second, k2.to(pool_ty))


@triton.jit
def _mla_prologue_kernel(
    q_ptr, kv_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, pool_ptr,
    num_heads, eps, stride_pos, stride_slot, stride_qt, stride_qh, stride_kvt, stride_cos, stride_sin,
    stride_page, page_size,
    NOPE: tl.constexpr, KV_LORA: tl.constexpr, BLOCK_LORA: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVE: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
    cos, sin = _rope_tables(cos_ptr, sin_ptr, pos, stride_cos, stride_sin, HALF, q_ptr.dtype.element_ty)
    first, second = _pair_offsets(HALF, INTERLEAVE)

    # the query's rope dims, every head
    h = tl.arange(0, BLOCK_H)
    h_ok = (h < num_heads)[:, None]
    q_row = q_ptr + t * stride_qt + h[:, None] * stride_qh + NOPE
    q1 = tl.load(q_row + first[None, :], mask=h_ok, other=0.0).to(tl.float32)
    q2 = tl.load(q_row + second[None, :], mask=h_ok, other=0.0).to(tl.float32)
    q1, q2 = _rotate(q1, q2, cos[None, :], sin[None, :], q_ptr.dtype.element_ty)
    tl.store(q_row + first[None, :], q1, mask=h_ok)
    tl.store(q_row + second[None, :], q2, mask=h_ok)

    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    _latent_entry(kv_ptr + t * stride_kvt, w_ptr, cos, sin, slot, pool_ptr, eps, stride_page, page_size, KV_LORA,
                  BLOCK_LORA, HALF, INTERLEAVE)


class Prologue(NamedTuple):
    """What ``mla_prologue`` takes besides the query (tandem/kernels/mla_absorb.py's absorb_q takes it too)."""
    kv_a: torch.Tensor  # [T, kv_lora + rope]: latent normalised and key rotated in place
    norm_weight: torch.Tensor  # [kv_lora]
    eps: float
    cos: torch.Tensor  # float32 [max_pos, rope / 2] (YarnRotary.cos)
    sin: torch.Tensor
    positions: torch.Tensor  # [T]
    pool: torch.Tensor  # [num_pages, page_size, 1, kv_lora + rope] (or without the 1)
    slot_mapping: torch.Tensor  # [T]: page * page_size + offset; negative = skip
    interleave: bool


def prologue_shapes(q: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor, pool: torch.Tensor) -> tuple[int, int]:
    """``(kv_lora, rope / 2)`` of a prologue's tensors, or a ValueError saying what does not agree."""
    num_tokens, heads, head_dim = q.shape
    kv_lora, half = norm_weight.shape[0], cos.shape[1]
    rope = 2 * half
    width = kv_lora + rope
    if kv_a.shape != (num_tokens, width) or head_dim <= rope or sin.shape != cos.shape:
        raise ValueError(f"MLA shapes do not agree: q {tuple(q.shape)}, kv_a {tuple(kv_a.shape)}, "
                         f"norm {tuple(norm_weight.shape)}, cos {tuple(cos.shape)}")
    if pool.shape[-1] != width or pool[0, 0].numel() != width or not pool.is_contiguous():
        raise ValueError(f"pool {tuple(pool.shape)} does not hold contiguous latent entries of {width}")
    if half & (half - 1):
        raise ValueError(f"rope dims {rope}: the kernel needs a power of two")
    for name, x in (("q", q), ("kv_a", kv_a), ("cos", cos), ("sin", sin), ("norm_weight", norm_weight)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    return kv_lora, half


def mla_prologue(q: torch.Tensor, *prologue) -> None:
    """``q`` [T, H, nope + rope], its rope dims rotated in place; ``prologue``: the fields of ``Prologue``."""
    kv_a, norm_weight, eps, cos, sin, positions, pool, slot_mapping, interleave = Prologue(*prologue)
    kv_lora, half = prologue_shapes(q, kv_a, norm_weight, eps, cos, sin, pool)
    num_tokens, heads, head_dim = q.shape
    if num_tokens == 0:
        return
    _mla_prologue_kernel[(num_tokens,)](
        q, kv_a, norm_weight, cos, sin, positions, slot_mapping, pool,
        heads, eps, positions.stride(0), slot_mapping.stride(0), q.stride(0), q.stride(1), kv_a.stride(0),
        cos.stride(0), sin.stride(0), pool.stride(0), pool.shape[1],
        NOPE=head_dim - 2 * half, KV_LORA=kv_lora, BLOCK_LORA=triton.next_power_of_2(kv_lora), HALF=half,
        BLOCK_H=triton.next_power_of_2(heads), INTERLEAVE=interleave, num_warps=4, **pdl_launch(q),
    )
