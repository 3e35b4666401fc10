"""RMSNorm, optionally fused with the residual add that precedes it (the vLLM ``fused_add_rms_norm``
pattern): one pass over the row instead of an add kernel, a float32 upcast, a reduction and two
multiplies.

The roundings are the reference's (tandem.layers.norm.RMSNorm after ``h = x + residual`` in the model
dtype): the sum is rounded to the dtype before it is normalised, the normalised row is rounded to the
dtype before it meets the weight, and the product is rounded to the result dtype, so bf16 results
agree with the unfused model bit for bit up to the last ulp of rsqrt.

Rows are addressed as (outer, inner) with two strides, so a per-head q/k norm runs straight on a
``[T, heads, D]`` view of the fused QKV output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    inner, size, eps,
    sx0, sx1, sr0, sr1, so0, so1, sro0, sro1,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0)
    outer = (row // inner).to(tl.int64)
    in_row = (row % inner).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < size
    x = tl.load(x_ptr + outer * sx0 + in_row * sx1 + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + outer * sr0 + in_row * sr1 + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the model rounds h
        tl.store(res_out_ptr + outer * sro0 + in_row * sro1 + cols, x.to(res_out_ptr.dtype.element_ty), mask=ok)
    x32 = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x32 * x32, 0) / size + eps)
    normed = (x32 * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + outer * so0 + in_row * so1 + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, inner, stride of outer, stride of inner) for a [R, H] or [T, heads, H] tensor."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"rms_norm takes [rows, H] or [T, heads, H], got {tuple(x.shape)}")


def rms_norm(
    x: torch.Tensor,  # [R, H] or [T, heads, H]; last dim contiguous, rows may be strided
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # same shape as x: normalise h = x + residual instead
    out: torch.Tensor | None = None,  # may alias x
    residual_out: torch.Tensor | None = None,  # where h goes (may alias residual or x); new if None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * rmsnorm(x)``; with ``residual``, returns ``(weight * rmsnorm(h), h)`` for ``h = x + residual``."""
    size = x.shape[-1]
    if weight.shape != (size,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match rows of {size}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("rms_norm needs a contiguous last dimension")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is not None:
        if residual.shape != x.shape or residual.stride(-1) != 1:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        if residual_out is None:
            residual_out = torch.empty_like(x)
        res, res_out = residual, residual_out
    else:
        res, res_out = x, out  # never touched
    rows, inner, sx0, sx1 = _rows(x)
    if rows == 0:
        return out if residual is None else (out, residual_out)
    _, _, sr0, sr1 = _rows(res)
    _, _, so0, so1 = _rows(out)
    _, _, sro0, sro1 = _rows(res_out)
    block = triton.next_power_of_2(size)
    _rms_norm_kernel[(rows,)](
        x, res, weight, out, res_out, inner, size, eps,
        sx0, sx1, sr0, sr1, so0, so1, sro0, sro1,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=max(1, min(16, block // 512)),  # ~4 16-byte vectors per thread at bf16
        **pdl_launch(x),
    )
    return out if residual is None else (out, residual_out)
