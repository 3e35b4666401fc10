"""The routed experts of a few tokens slot by slot: one GEMV program row per (token, expert) slot, reading
that slot's expert's weight as the checkpoint stores it (INT4, FP8 or plain bf16/fp16/fp32; the
bandwidth-minded GEMV kernel of tandem/kernels/dequant_gemv.py, its weight pointer moved to the slot's
expert on the device), then ``silu(gate) * up``, the down GEMV per slot, and the weighted sum of each
token's slots.

Why: at decode (a token's 6–8 slots, mostly on different experts) the grouped GEMM of
tandem/kernels/fused_moe.py pads each expert's one row to a 16-row tensor-core tile and dequantizes the
tile for it; the INT4 tiles streamed 7–15 % of the bandwidth there. Here each packed weight is read once per
slot with one row's arithmetic, as the one-row linear GEMV reads a dense weight. A weight two slots share is
read twice (from L2 if close in time): the grouped GEMM takes over where slots outnumber experts.
Plain experts have nothing to dequantize; what the slots spare them is the 16-row padding of each slot's row
and the grouping's launches (the sort by expert; the weighted sum is the same kernel on both routes).
No host synchronisation: the expert ids stay on the device (graph-safe).

Rounding as the grouped GEMM's: gate and up rounded to the activation dtype, then the silu, then their
product; each slot's down product rounded, then weighted in float32, the slots summed in float32, rounded,
then ``add``. A plain weight is rounded to the activation dtype before its products, as the grouped GEMM's tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.dequant_gemm import slot_linear
from tandem.kernels.dequant_gemv import gemv_block_k, plain_word
from tandem.kernels.dequant_tiles import FP8, INT4, PLAIN
from tandem.kernels.pdl import pdl_enter, pdl_launch

# Up to this many slots (tokens x top_k) the routed experts go slot by slot: a decode or verify step of a
# few requests. The grouped GEMM reads each touched expert once for all its rows, which wins once several
# rows share experts (bench --sections quant_kernels times both).
SLOTS_MAX = 64
# The same for plain (float) experts: a decode step of two tokens at top-8. Without a dequantization to spare, the
# slots' gain is the tile padding and the grouping's launches, which the re-reads of shared experts outweigh
# sooner: the grouped GEMM reads a shared expert once for its rows (bench --sections quant_kernels to tune).
PLAIN_SLOTS_MAX = 16


def _slot_ready(w) -> bool:
    """Whether the slot GEMV reads ``w`` (an ExpertWeights): whole words in each scale group (INT4, FP8), or a
    bf16/fp16/fp32 plain weight of whole 16-byte words per row."""
    if w.format == PLAIN:
        word = plain_word(w.weight.dtype)
        return word is not None and w.weight.shape[-1] % word == 0
    return w.format in (INT4, FP8) and gemv_block_k(w.format, w.block[1], 1024) is not None


def slots_apply(slots: int, gate_up, down) -> bool:
    """Whether fused_moe's ``slots`` slots (tokens x top_k) of these ExpertWeights go slot by slot."""
    limit = PLAIN_SLOTS_MAX if gate_up.format == PLAIN else SLOTS_MAX
    return 0 < slots <= limit and gate_up.format == down.format and _slot_ready(gate_up) and _slot_ready(down)


def routed_by_slots(x: torch.Tensor, gate_up, down, route_weights: torch.Tensor, ids: torch.Tensor,
                    add: torch.Tensor | None = None, join=None) -> torch.Tensor:
    """fused_moe's result (same arguments; ``gate_up`` / ``down``: its ExpertWeights) slot by slot."""
    tokens, hidden = x.shape
    top_k, inter = ids.shape[1], gate_up.weight.shape[1] // 2
    flat_ids = ids.reshape(-1).contiguous()
    gate_up_rows = slot_linear(x, gate_up.weight, gate_up.scale, gate_up.block, gate_up.format, flat_ids, 2 * inter,
                               top_k)
    # silu(gate) * up read by the down GEMV: no activation launch; the ids settled (the gate-up launch came between)
    per_slot = slot_linear(gate_up_rows, down.weight, down.scale, down.block, down.format, flat_ids, hidden, 1,
                           swiglu=True, ids_settled=True)
    if join is not None:
        join()
    return sum_slots(per_slot, top_k, route_weights.float().reshape(-1).contiguous(), add, x.dtype)


@triton.jit
def _sum_slots_kernel(per_slot_ptr, route_w_ptr, add_ptr, out_ptr, hidden, stride_add, stride_out,
                      TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK_H: tl.constexpr,
                      PDL: tl.constexpr):
    """A token's k slots (times their routing weights where ``WEIGHTED``) summed in float32 and rounded to the
    output dtype, then ``add`` (the shared experts' output) added as the model adds it: one launch for what was
    a sum, a cast and an add."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(per_slot_ptr + (t * TOP_K + j) * hidden + h, mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            row *= tl.load(route_w_ptr + t * TOP_K + j)
        acc += row
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_ADD:
        shared = tl.load(add_ptr + t * stride_add + h, mask=ok, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + shared).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_out + h, out, mask=ok)


def sum_slots(per_slot: torch.Tensor, top_k: int, route_w: torch.Tensor | None, add: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    """``per_slot`` ``[T * top_k, H]`` (already weighted where ``route_w`` is None) → ``[T, H]`` in ``dtype``."""
    hidden = per_slot.shape[1]
    tokens = per_slot.shape[0] // top_k
    out = per_slot.new_empty((tokens, hidden), dtype=dtype)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _sum_slots_kernel[(tokens, triton.cdiv(hidden, block_h))](
        per_slot, route_w if route_w is not None else per_slot, add if add is not None else out, out, hidden,
        add.stride(0) if add is not None else 0, out.stride(0), TOP_K=top_k, WEIGHTED=route_w is not None,
        HAS_ADD=add is not None, BLOCK_H=block_h, num_warps=4, **pdl_launch(per_slot))
    return out
