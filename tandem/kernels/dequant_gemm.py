"""``y = x Wᵀ (+ b)`` with W quantized as the checkpoint stores it, dequantized tile by tile in the kernel:
W4A16 (compressed-tensors INT4 ``pack-quantized``, one scale per group of input columns) and W8A16
(FP8 e4m3 with one ``scale_inv`` per block), for bf16, fp16 or float32 activations.

One kernel here serves every row count (for few rows the default is another: see the end). Each
program owns ``BLOCK_N`` output features of ``BLOCK_M`` rows and walks K, multiplying the activation tile with
the dequantized weight tile on the tensor cores (``tl.dot``, float32 accumulation); the ``rows`` variant (one
row per program, CUDA-core products into a ``[BLOCK_K, BLOCK_N]`` float32 accumulator reduced once, as
tandem/kernels/gemv.py's one-row kernel) skips the tensor cores' shared-memory round trip for a single row. A
decode or verify step (a few rows) is a GEMV: the rows are padded to 16 in registers, the grid splits N only,
and the packed weight is streamed once; a batch of a few hundred rows takes GEMM tiles. Where even 16-row N
tiles leave the GPU's SMs without programs (a tensor-parallel shard: a TP 8 shared expert's gate/up is 512 x
7168), K is split too: each split writes float32 partial sums, summed in order afterwards (deterministic, one
more launch), then the bias and one rounding.
float32 activations multiply in full precision (``ieee``), not tf32.
Which kernel and tile a call takes is tandem/kernels/dequant_configs.py's ``default_config``: for few rows the
``gemv`` kernel (tandem/kernels/dequant_gemv.py, written for the read bandwidth; ``_launch`` splits K for it the
same way), INT4 ``mma_sync`` (tandem/kernels/dequant_mma_sync.py) and ``mma`` (tandem/kernels/dequant_mma.py).
Tile loaders: tandem/kernels/dequant_tiles.py. Graph-safe: the launch depends on shapes only.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from tandem.kernels.activation import fold_swiglu, silu_and_mul
from tandem.kernels.dequant_configs import DequantConfig, _gemv_split, default_config
from tandem.kernels.dequant_gemv import INT4_HI_SHIFT, _dequant_gemv_kernel, gemv_block_k, plain_word
from tandem.kernels.dequant_mma import _dequant_mma_kernel
from tandem.kernels.dequant_tiles import FP8, INT4, PLAIN, interpreting, weight_tile, whole_groups
from tandem.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _dequant_matmul_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_sn, stride_ym, stride_ys,
    K: tl.constexpr, K_SPLIT: tl.constexpr, FORMAT: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr,
    WHOLE_GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """``K_SPLIT``: the columns one program covers (all of K, or one split's share, written as float32
    partial sums at ``y_ptr + split * stride_ys``)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, N - 1)  # the last tile re-reads valid rows; only its store is masked
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    pdl_enter(PDL)
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc_k = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for kk in range(0, K_SPLIT, BLOCK_K):
        k = pid_s * K_SPLIT + kk
        offs_k = k + tl.arange(0, BLOCK_K)
        xv = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        w = weight_tile(FORMAT, w_ptr, s_ptr, rows_n, k, K, stride_wn, stride_sn, S_ROWS, S_COLS, BLOCK_K,
                        WHOLE_GROUPS).to(xv.dtype)
        if not USE_DOT:  # BLOCK_M == 1: xv is [1, BLOCK_K]
            acc_k += w.to(tl.float32) * tl.reshape(xv, [BLOCK_K, 1]).to(tl.float32)
        elif INTERPRET:  # the interpreter's tl.dot mishandles bf16 (raw uint16); the products are exact in fp32
            acc = tl.dot(xv.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xv, w, acc, input_precision=PRECISION)
    if not USE_DOT:
        acc = tl.reshape(tl.sum(acc_k, axis=0), [1, BLOCK_N])
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n).to(tl.float32)[None, :]
    y_ptrs = y_ptr + pid_s.to(tl.int64) * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_n < N)[None, :])


@triton.jit
def _split_sum_kernel(p_ptr, b_ptr, y_ptr, N, stride_ps, stride_pm, stride_ym, SPLIT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row ``program_id(1)`` of y: the splits' float32 partial sums added in split order (deterministic),
    plus the bias, rounded once. One launch where torch took two or three."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    p_ptr += tl.program_id(1).to(tl.int64) * stride_pm + offs
    pdl_enter(PDL)
    acc = tl.load(p_ptr, mask=ok, other=0.0)
    for split in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + split * stride_ps, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + tl.program_id(1).to(tl.int64) * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _launch(x, w, s, bias, n, fmt, s_rows, s_cols, config, out, ids=None, slots_per_row=0, swiglu=False,
            ids_settled=False):
    """``ids``: mixture-of-experts slots (``slot_linear``): w and s stacked per expert, one output row per
    slot, the one-row GEMV kernel only (checked here, so the general fall-back below never sees slots). A plain
    weight (PLAIN, slots only: ``s`` None) must hold whole 16-byte words per row (``plain_word``). ``swiglu``: x
    is [..., 2K] = [gate | up] and the product is with silu(gate) * up — read so by the GEMV kernel where
    fold_swiglu allows, computed apart otherwise and for the other kernels."""
    k = x.shape[-1] // 2 if swiglu else x.shape[-1]
    if fmt == PLAIN:
        word = plain_word(w.dtype)
        if ids is None or word is None or k % word:
            raise ValueError(f"plain weights take the slot GEMV only, bf16/fp16/fp32 rows of whole 16-byte words; "
                             f"got {w.dtype} [..., {k}]")
        s = w  # never read
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quantized linear kernels take bf16, fp16 or float32 activations, got {x.dtype}")
    if w.stride(-1) != 1 or s.stride(-1) != 1:
        raise ValueError("quantized linear kernels need the weight and scale rows contiguous")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0] if ids is None else ids.numel()
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*lead, n)
    if ids is None:
        cfg = config or default_config(m, n, k, x.dtype, fmt=fmt, group=s_cols)
    else:  # one slot a program row (its own expert), K split for the grid the slots give
        lead = (m,)
        cfg = config or default_config(1, n, k, x.dtype, fmt=fmt, slots=True)
        if cfg.kernel != "gemv" or cfg.block_m != 1 or gemv_block_k(fmt, s_cols, cfg.block_k) is None:
            raise ValueError(f"expert slots take the one-row GEMV kernel and whole words per scale group; got {cfg}")
        if config is None and not interpreting():
            steps = triton.cdiv(k, gemv_block_k(fmt, s_cols, cfg.block_k))
            cfg = dataclasses.replace(cfg, split_k=_gemv_split(triton.cdiv(n, cfg.block_n) * m, steps))
    if swiglu and cfg.kernel != "gemv":
        x2, swiglu = silu_and_mul(x2), False
    block_k, block_m = cfg.block_k, cfg.block_m
    if cfg.kernel == "gemv":
        block_k = gemv_block_k(fmt, s_cols, cfg.block_k)
        if block_k is None and config is not None:
            raise ValueError(f"the GEMV kernel does not take groups of {s_cols} columns")
        if block_k is None:
            cfg = default_config(m, n, k, x.dtype, gemv_max_rows=0, fmt=fmt)
            block_k, block_m = cfg.block_k, cfg.block_m
            if swiglu:
                x2, swiglu = silu_and_mul(x2), False
        else:
            block_m = min(block_m, m)
    elif cfg.kernel == "mma":
        if fmt != INT4 or x.dtype == torch.float32 or s_cols < 16 or s_cols & (s_cols - 1):
            raise ValueError(f"the mma kernel takes INT4 groups of 16, 32, 64 ... columns and bf16/fp16 activations; "
                             f"got groups of {s_cols}, {x.dtype}")
        block_k = max(s_cols, block_k // s_cols * s_cols)
    elif cfg.kernel == "mma_sync":
        from tandem.kernels import dequant_mma_sync  # (Gluon: not in every Triton, gluon_available)

        if fmt != INT4:
            raise ValueError("the mma_sync kernel takes INT4 weights")
        dequant_mma_sync.check(cfg.block_n, block_k, cfg.num_warps, s_cols, x.dtype, k)
    if swiglu and not fold_swiglu(triton.cdiv(n, cfg.block_n) * m * k):
        x2, swiglu = silu_and_mul(x2), False
    split = max(1, min(cfg.split_k, triton.cdiv(k, block_k)))
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    target = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m), split)
    b = bias if bias is not None else s
    stride_ys = target.stride(0) if split > 1 else 0
    pdl = pdl_launch(x)
    shared = dict(K=k, K_SPLIT=k_split, HAS_BIAS=bias is not None and split == 1, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    formatted = dict(shared, FORMAT=fmt, S_ROWS=s_rows, S_COLS=s_cols)  # the gemv and tile kernels take any format
    if cfg.kernel == "mma_sync":
        dequant_mma_sync.launch(x2, w, s, b, target, m, n, k, split, k_split, stride_ys, cfg.block_n,
                                shared["HAS_BIAS"], pdl)
    elif cfg.kernel == "mma":  # (INT4 only: its groups are GROUP columns of one row)
        _dequant_mma_kernel[grid](
            x2, w, s, b, target, m, n, x2.stride(0), target.stride(-2), stride_ys, STRIDE_W=w.stride(0),
            STRIDE_S=s.stride(0), GROUP=s_cols, BLOCK_M=block_m, ASM=not interpreting(), INTERPRET=interpreting(),
            **shared)
    elif cfg.kernel == "gemv":
        experts = ids is not None
        _dequant_gemv_kernel[grid](
            x2, w, s, b, target, ids if experts else s, m, n, x2.stride(0), target.stride(-2), stride_ys,
            w.stride(0) if experts else 0, s.stride(0) if experts else 0, INT4_HI_SHIFT, STRIDE_W=w.stride(-2),
            STRIDE_S=s.stride(-2), EVEN_N=n % cfg.block_n == 0, ROWS=block_m, SLOTS_PER_ROW=slots_per_row,
            SWIGLU=swiglu, **dict(formatted, num_stages=1), AHEAD=max(1, cfg.num_stages - 1), IDS_SETTLED=ids_settled,
            CLAMPED=cfg.clamped_read_ahead)
    else:
        _dequant_matmul_kernel[grid](
            x2, w, s, b, target, m, n, x2.stride(0), w.stride(0), s.stride(0), target.stride(-2), stride_ys,
            WHOLE_GROUPS=whole_groups(fmt, s_cols, block_k), BLOCK_M=block_m, USE_DOT=cfg.kernel == "dot",
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", INTERPRET=interpreting(), **formatted)
    if split > 1:
        _split_sum_kernel[(triton.cdiv(n, 1024), m)](
            target, b, y, n, target.stride(0), target.stride(1), y.stride(-2), SPLIT=split, HAS_BIAS=bias is not None,
            BLOCK=1024, num_warps=4, **pdl)
    return y.view(*lead, n)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None, config: DequantConfig | None = None,
                out: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """W4A16: ``x [..., K]`` times ``W [N, K]`` given as ``packed [N, ceil(K/8)]`` int32 and
    ``scale [N, ceil(K/group_size)]`` float32, bf16 or fp16 → ``[..., N]`` in x's dtype. ``swiglu``: x is ``[..., 2K]``
    (gate | up), multiplied as ``silu(gate) * up``."""
    n, k = packed.shape[0], x.shape[-1] // (2 if swiglu else 1)
    if packed.dtype != torch.int32 or packed.shape[1] != triton.cdiv(k, 8) or group_size % 8:
        raise ValueError(f"int4_linear: packed {tuple(packed.shape)} {packed.dtype} does not hold [{n}, {k}] int4")
    if tuple(scale.shape) != (n, triton.cdiv(k, group_size)):
        raise ValueError(f"int4_linear: scale {tuple(scale.shape)}, expected {(n, triton.cdiv(k, group_size))}")
    return _launch(x, packed, scale, bias, n, INT4, 1, group_size, config, out, swiglu=swiglu)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None, config: DequantConfig | None = None,
                     out: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """W8A16: ``x [..., K]`` times ``W = weight * scale_inv`` (e4m3 ``[N, K]``, float32 ``scale_inv``
    ``[ceil(N/bn), ceil(K/bk)]``) → ``[..., N]`` in x's dtype. ``swiglu``: as int4_linear's."""
    n, k = weight.shape
    expected = (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    if k * (2 if swiglu else 1) != x.shape[-1] or weight.dtype != torch.float8_e4m3fn or tuple(scale_inv.shape) != expected:
        raise ValueError(f"fp8_block_linear: weight {tuple(weight.shape)} {weight.dtype}, scale_inv "
                         f"{tuple(scale_inv.shape)} (expected {expected}) for x [..., {x.shape[-1]}]")
    return _launch(x, weight, scale_inv, bias, n, FP8, block[0], block[1], config, out, swiglu=swiglu)


def slot_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int], fmt: int,
                ids: torch.Tensor, n: int, slots_per_row: int, swiglu: bool = False,
                config: DequantConfig | None = None, ids_settled: bool = False) -> torch.Tensor:
    """Mixture-of-experts slots (tandem/kernels/moe_slots.py): ``[ids.numel(), n]`` in x's dtype, row ``s`` the
    activation row ``s // slots_per_row`` times the weight of expert ``ids[s]`` (``weight`` / ``scale`` stacked
    per expert in format ``fmt``, one scale per ``block``; a plain weight: no scale). ``swiglu``: as int4_linear's.
    ``config``: a one-row GEMV tile (bench/slot_gemv_sweep.py), else the default's. ``ids_settled``: ``ids`` were
    written before the kernel just before this launch (the down projection's: the gate-up launch came between), so
    the slots' ids and first weights are read before the PDL wait (tandem/kernels/pdl.py)."""
    return _launch(x, weight, scale, None, n, fmt, block[0], block[1], config, None, ids=ids,
                   slots_per_row=slots_per_row, swiglu=swiglu, ids_settled=ids_settled)
