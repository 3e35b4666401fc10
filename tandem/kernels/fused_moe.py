"""Fused mixture-of-experts for the GPU: the routed experts' SwiGLU MLPs for all tokens in two grouped
GEMM launches, with no host synchronisation (capturable in a CUDA graph).

1. ``align_by_expert`` sorts the ``T * top_k`` (token, slot) pairs by expert on the device and lays them
   out in blocks of ``BLOCK_M`` rows, each block owned by one expert (the last block of an expert padded
   with a sentinel slot), as vLLM's ``moe_align_block_size`` does: one Triton program for decode and
   verify batches, torch ops for larger ones. The number of blocks is bounded by
   the shapes alone (``ceil(T*k / BLOCK_M) + min(E, T*k)``); blocks past the end are marked empty.
2. The gate/up launch: per block, the tokens' activations times the expert's gate and up tiles, then
   ``silu(gate) * up`` in registers (rounded to the activation dtype at each step, as the reference's
   separate ops round), written per slot.
3. The down launch: per block, those rows times the expert's down tile, scaled by the slot's routing
   weight, written per slot in float32; the slots of a token are then summed (no atomics: the result
   does not depend on scheduling).

Quantized experts of a decode or verify step (up to moe_slots.SLOTS_MAX slots) go slot by slot instead
(tandem/kernels/moe_slots.py): a 16-row tensor-core tile spends its time dequantizing for one row per expert.
Plain experts too, up to moe_slots.PLAIN_SLOTS_MAX slots: there the 16-row padding and the grouping's launches.

Expert weights are stacked ``[E, N, K]`` in any format of tandem/kernels/dequant_tiles.py (a float
weight, INT4 pack-quantized with its group scales, FP8 with its block scales), dequantized in the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels.dequant_configs import PROGRAMS_WANTED
from tandem.kernels.dequant_tiles import FP8, INT4, PLAIN, interpreting, weight_tile, whole_groups
from tandem.kernels.moe_slots import routed_by_slots, slots_apply, sum_slots
from tandem.kernels.rounding import round_to
from tandem.kernels.pdl import pdl_enter, pdl_launch


@dataclass(frozen=True)
class ExpertWeights:
    """One stacked projection of every expert: ``weight`` ``[E, N, K']`` (float, int32 packed or e4m3),
    ``scale`` its ``[E, ., .]`` scales (None for a float weight), ``block`` the rows and columns one
    scale covers (``(1, group)`` for INT4)."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    block: tuple[int, int] = (1, 1)

    @property
    def format(self) -> int:
        if self.scale is None:
            return PLAIN
        return INT4 if self.weight.dtype == torch.int32 else FP8

    def check(self, experts: int, n: int, k: int, what: str) -> None:
        """Raise unless this holds ``experts`` weights of ``[n, k]`` in its format, rows contiguous."""
        cols = triton.cdiv(k, 8) if self.format == INT4 else k
        shapes = [(tuple(self.weight.shape), (experts, n, cols))]
        if self.scale is not None:
            scales = (experts, triton.cdiv(n, self.block[0]), triton.cdiv(k, self.block[1]))
            shapes.append((tuple(self.scale.shape), scales))
        for got, want in shapes:
            if got != want:
                raise ValueError(f"fused_moe: {what} has a tensor of shape {got}, expected {want}")
        if self.weight.stride(-1) != 1 or (self.scale is not None and self.scale.stride(-1) != 1):
            raise ValueError(f"fused_moe: {what} needs contiguous rows")


ALIGN_KERNEL_MAX_SLOTS = 2048  # up to here one program sorts the slots; beyond, torch ops do


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids ``[T, k]`` → (``slots`` ``[B * block_m]`` int32: the flat (token * k + j) slot of each
    row, ``T * k`` for padding; ``block_expert`` ``[B]`` int32: each block's expert, ``num_experts``
    for an empty block). Fixed shapes, device work only; the slots of an expert in slot order. Decode
    and verify batches (up to ALIGN_KERNEL_MAX_SLOTS slots) take one Triton program, where the torch ops
    would be a dozen launches per MoE layer."""
    n = ids.numel()
    if n > ALIGN_KERNEL_MAX_SLOTS:
        return align_by_expert_torch(ids, num_experts, block_m)
    max_blocks = triton.cdiv(n, block_m) + min(num_experts, n)
    slots = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    experts_p = triton.next_power_of_2(num_experts + 1)  # one more bin: the padding lanes' sentinel
    scratch = torch.empty(experts_p, dtype=torch.int32, device=ids.device)
    _align_kernel[(1,)](
        ids.reshape(-1), slots, block_expert, scratch, n, E=num_experts, EP=experts_p,
        NP=triton.next_power_of_2(n), BLOCK_M=block_m, MAX_BLOCKS=max_blocks,
        ROWS_P=triton.next_power_of_2(max_blocks * block_m), BLOCKS_P=triton.next_power_of_2(max_blocks),
        MAX_PER_EXPERT=triton.cdiv(n, block_m), num_warps=4, **pdl_launch(ids),
    )
    return slots, block_expert


def align_by_expert_torch(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_by_expert`` in torch ops (any size): a stable sort by expert, then each slot's row."""
    flat = ids.flatten().long()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    first_row = (block_end - blocks) * block_m  # where each expert's rows start
    rank = torch.arange(n, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert_of_sorted]
    max_blocks = triton.cdiv(n, block_m) + min(num_experts, n)
    slots = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=ids.device)
    slots[first_row[expert_of_sorted] + rank] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=ids.device), right=True)
    return slots, block_expert.to(torch.int32)


@triton.jit
def _align_kernel(
    ids_ptr, slots_ptr, block_expert_ptr, scratch_ptr, n,
    E: tl.constexpr, EP: tl.constexpr, NP: tl.constexpr, BLOCK_M: tl.constexpr, MAX_BLOCKS: tl.constexpr,
    ROWS_P: tl.constexpr, BLOCKS_P: tl.constexpr, MAX_PER_EXPERT: tl.constexpr, PDL: tl.constexpr,
):
    """One program: per-expert counts (a histogram), block offsets (a cumsum), the slots sorted by
    (expert, slot) with one bitonic sort of ``expert * NP + slot``; each slot's row is its expert's first
    row plus its position in the sort minus the slots of the experts before it."""
    pdl_enter(PDL)
    lanes = tl.arange(0, NP)
    expert = tl.load(ids_ptr + lanes, mask=lanes < n, other=E).to(tl.int32)  # padding lanes: the spare bin E
    experts = tl.arange(0, EP)
    counts = tl.where(experts < E, tl.histogram(expert, EP), 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_start = tl.cumsum(blocks, 0) - blocks
    slots_before = tl.cumsum(counts, 0) - counts
    rows = tl.arange(0, ROWS_P)
    tl.store(slots_ptr + rows, n, mask=rows < MAX_BLOCKS * BLOCK_M)
    blocks_i = tl.arange(0, BLOCKS_P)
    tl.store(block_expert_ptr + blocks_i, E, mask=blocks_i < MAX_BLOCKS)
    tl.store(scratch_ptr + experts, block_start * BLOCK_M - slots_before)
    tl.debug_barrier()  # the fills and the table above are visible to every thread of the program
    keys = tl.sort(expert * NP + lanes)
    sorted_expert = keys // NP
    real = sorted_expert < E
    row = tl.load(scratch_ptr + sorted_expert, mask=real, other=0) + lanes
    tl.store(slots_ptr + row, keys % NP, mask=real)
    for j in range(MAX_PER_EXPERT):
        tl.store(block_expert_ptr + block_start + j, experts, mask=(j < blocks) & (experts < E))


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, out_ptr, slots_ptr, block_expert_ptr, route_w_ptr,
    num_slots, N, num_experts, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    K: tl.constexpr, SLOTS_PER_ROW: tl.constexpr, GATED: tl.constexpr,
    WEIGHTED: tl.constexpr, FORMAT: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr,
    WHOLE_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """Rows of ``a`` are ``slot // SLOTS_PER_ROW`` (the token for gate/up, the slot itself for down).
    ``GATED``: N is the intermediate size; rows n and N + n of W give gate and up, the output is
    ``silu(gate) * up``. ``WEIGHTED``: the output is scaled by the slot's routing weight."""
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    pdl_enter(PDL)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert < num_experts:
        slots = tl.load(slots_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = slots < num_slots
        a_rows = a_ptr + (slots // SLOTS_PER_ROW).to(tl.int64)[:, None] * stride_am
        w_e = w_ptr + expert.to(tl.int64) * stride_we
        s_e = s_ptr + expert.to(tl.int64) * stride_se
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_n = tl.minimum(offs_n, N - 1)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            a = tl.load(a_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
            w = weight_tile(FORMAT, w_e, s_e, rows_n, k, K, stride_wn, stride_sn, S_ROWS, S_COLS, BLOCK_K,
                            WHOLE_GROUPS).to(a.dtype)
            if INTERPRET:  # the interpreter's tl.dot mishandles bf16 (raw uint16); the products are exact in fp32
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GATED:
                wu = weight_tile(FORMAT, w_e, s_e, rows_n + N, k, K, stride_wn, stride_sn, S_ROWS, S_COLS, BLOCK_K,
                                 WHOLE_GROUPS).to(a.dtype)
                if INTERPRET:
                    acc_up = tl.dot(a.to(tl.float32), wu.to(tl.float32), acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
        dtype = a_ptr.dtype.element_ty
        if GATED:  # (round_to: a cast's round trip may be folded away on the GPU, truncates in the interpreter)
            gate = round_to(acc, dtype)
            act = round_to(gate / (1.0 + tl.exp(-gate)), dtype)
            result = round_to(act * round_to(acc_up, dtype), dtype)
        elif WEIGHTED:
            route_w = tl.load(route_w_ptr + slots, mask=m_ok, other=0.0)
            result = round_to(acc, dtype) * route_w[:, None]
        else:
            result = acc
        out_ptrs = out_ptr + slots.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_n < N)[None, :])


@dataclass(frozen=True)
class MoeTiles:
    block_m: int
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_config(slots: int, num_experts: int, dtype: torch.dtype = torch.bfloat16, fmt: str | None = None) -> MoeTiles:
    """Rows per block from the expected rows per expert: decode and small batches put one or two tokens
    on an expert, so 16-row blocks (the tensor cores' minimum) waste least; large batches fill wider ones.
    float32 (full-precision products, no tensor cores) takes small tiles that fit in registers. ``fmt``:
    the experts' weight format (INT4 takes its own measured tiles)."""
    if dtype == torch.float32:
        return MoeTiles(16, block_n=32, block_k=32, num_warps=4, num_stages=2)
    per_expert = slots / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    if block_m == 16 and fmt == INT4:  # measured on the H200 at batch 1 and 8: 1.3-1.8x the tiles below
        return MoeTiles(16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if block_m == 16:  # few rows: wide K steps keep enough weight loads in flight
        return MoeTiles(16, block_n=32, block_k=256, num_warps=4, num_stages=3)
    return MoeTiles(block_m, block_n=64, block_k=64)


def _block_n(n: int, blocks: int, preferred: int) -> int:
    """Narrower N tiles where the preferred ones would give too few programs (a decode step at TP 8:
    gate/up of 256 intermediate rows for 8 tokens' blocks)."""
    block_n = preferred
    while block_n > 16 and triton.cdiv(n, block_n) * blocks < PROGRAMS_WANTED:
        block_n //= 2
    return block_n


def _grouped_gemm(a, w: ExpertWeights, out, slots, block_expert, route_w, n, slots_per_row, gated, weighted, cfg):
    weight, fmt = w.weight, w.format
    scale = w.scale if w.scale is not None else weight
    k = a.shape[1]
    block_n = _block_n(n, block_expert.numel(), cfg.block_n)
    grid = (triton.cdiv(n, block_n), block_expert.numel())
    _moe_gemm_kernel[grid](
        a, weight, scale, out, slots, block_expert, route_w if route_w is not None else out,
        slots_per_row * a.shape[0], n, weight.shape[0], a.stride(0), weight.stride(0),
        weight.stride(1), scale.stride(0), scale.stride(1), out.stride(0),
        K=k, SLOTS_PER_ROW=slots_per_row, GATED=gated, WEIGHTED=weighted, FORMAT=fmt,
        S_ROWS=w.block[0], S_COLS=w.block[1], WHOLE_GROUPS=whole_groups(fmt, w.block[1], cfg.block_k),
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", INTERPRET=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(a),
    )


def fused_moe(x: torch.Tensor, gate_up: ExpertWeights, down: ExpertWeights, route_weights: torch.Tensor,
              ids: torch.Tensor, config: MoeTiles | None = None, add: torch.Tensor | None = None,
              join=None) -> torch.Tensor:
    """``Σ_j route_weights[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t))`` with ``e = ids[t, j]``:
    ``x [T, H]``, gate_up ``[E, 2I, H]`` (gate rows first), down ``[E, H, I]``, ``route_weights``
    ``[T, k]`` float32, ``ids [T, k]`` → ``[T, H]`` in x's dtype, plus ``add`` ``[T, H]`` if given (added
    after the sum is rounded to x's dtype). ``join``: called just before the launch that reads ``add`` (the
    stream that writes it joins the current one there: tandem/layers/side_stream.py)."""
    if add is not None and (add.shape != x.shape or add.stride(-1) != 1):
        raise ValueError(f"fused_moe: add {tuple(add.shape)} for x {tuple(x.shape)}")
    if x.dim() != 2 or ids.shape != route_weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, ids {tuple(ids.shape)}, weights {tuple(route_weights.shape)}")
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, inter = gate_up.weight.shape[0], gate_up.weight.shape[1] // 2
    gate_up.check(num_experts, 2 * inter, hidden, "gate_up")
    down.check(num_experts, hidden, inter, "down")
    if tokens == 0:
        if join is not None:
            join()
        return torch.empty_like(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    if config is None and slots_apply(tokens * top_k, gate_up, down):
        return routed_by_slots(x, gate_up, down, route_weights, ids, add, join)
    cfg = config or default_config(tokens * top_k, num_experts, x.dtype, gate_up.format)
    slots, block_expert = align_by_expert(ids, num_experts, cfg.block_m)
    act = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, act, slots, block_expert, None, inter, top_k, True, False, cfg)
    per_slot = torch.empty((tokens * top_k, hidden), dtype=torch.float32, device=x.device)
    route_w = route_weights.float().flatten().contiguous()
    _grouped_gemm(act, down, per_slot, slots, block_expert, route_w, hidden, 1, False, True, cfg)
    if join is not None:
        join()
    return sum_slots(per_slot, top_k, None, add, x.dtype)
