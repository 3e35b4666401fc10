"""SwiGLU activation of the fused gate/up projection: ``silu(gate) * up`` in one pass, where the
reference path materialises ``silu(gate)`` first. The silu is rounded to the dtype before the
product, as the two separate torch ops do, so bf16 results match them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.pdl import pdl_enter, pdl_launch
from tandem.kernels.rounding import round_to


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    act = swiglu_load(x_ptr + row * stride_x + cols, cols < inter, inter, x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, act.to(out_ptr.dtype.element_ty), mask=cols < inter)


@triton.jit
def swiglu_load(gate_ptrs, mask, inter, DTYPE: tl.constexpr):
    """``silu(gate) * up`` at ``gate_ptrs`` (up ``inter`` elements after), in float32 holding ``DTYPE``'s
    roundings as torch's two ops make them (the silu rounded, then the product; round_to, since a cast's round
    trip may be folded away or truncate): the activation kernel's output, or a GEMV's input read directly."""
    gate = load_f32(gate_ptrs, mask)
    up = load_f32(gate_ptrs + inter, mask)
    return round_to(round_to(gate / (1.0 + tl.exp(-gate)), DTYPE) * up, DTYPE)


@triton.jit
def activation_load(x_ptrs, mask, SWIGLU: tl.constexpr, K: tl.constexpr):
    """A GEMV's activations at ``x_ptrs`` in float32: loaded, or ``silu(gate) * up`` of a [gate | up] row of 2K."""
    if SWIGLU:
        return swiglu_load(x_ptrs, mask, K, x_ptrs.dtype.element_ty)
    else:
        return load_f32(x_ptrs, mask)


@triton.jit
def residual_sum(x_ptrs, res_ptrs, mask, DTYPE: tl.constexpr):
    """``x + residual`` in float32 holding ``DTYPE``'s rounding (the residual stream, as the model adds it)."""
    return round_to(load_f32(x_ptrs, mask) + load_f32(res_ptrs, mask), DTYPE)


@triton.jit
def normed_load(x_ptrs, res_ptrs, g_ptrs, mask, inv, DTYPE: tl.constexpr):
    """RMSNorm's output at these columns of ``x + residual`` whose rsqrt(mean square + eps) is ``inv``, in float32
    holding tandem/kernels/norm.py's roundings: the sum, the normalised value, its product with the weight ``g``."""
    h = residual_sum(x_ptrs, res_ptrs, mask, DTYPE)
    return round_to(round_to(h * inv, DTYPE) * load_f32(g_ptrs, mask), DTYPE)


@triton.jit
def load_f32(ptrs, mask):
    """A load in float32, masked (zeros outside) unless ``mask`` is None (unmasked loads vectorise freely)."""
    if mask is None:
        return tl.load(ptrs).to(tl.float32)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


# A GEMV that reads [gate | up] (swiglu_load) computes silu(gate) * up again in every program that walks K: one launch
# less is worth it only while that work is small. On the H200 the 8B shape's bf16 down GEMV (1024 programs x 14336
# columns) spent ~7 us a layer on it, ~0.5 ps an activation: 4 Mi recomputed activations cost ~2 us, about the launch
# saved. Above, the GEMV wrappers run this module's kernel first and the GEMV on its output.
SWIGLU_FOLD_MAX = 4 << 20


# A GEMV that applies its input's RMSNorm (gemv.py's NORM) reads x + residual twice in every program (the mean square,
# then the normalised products) and rounds three times a column: about twice silu's work an activation, so half the
# budget (unmeasured: the ratio is the instruction count's).
NORM_FOLD_MAX = SWIGLU_FOLD_MAX // 2


def fold_norm(recomputed: int) -> bool:
    """Whether a one-row GEMV whose programs read ``recomputed`` activations in all applies its input's norm itself."""
    return recomputed <= NORM_FOLD_MAX


def fold_swiglu(recomputed: int) -> bool:
    """Whether a GEMV whose programs compute ``recomputed`` activations in all (programs x rows x K) reads [gate | up]
    itself."""
    return recomputed <= SWIGLU_FOLD_MAX


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, 2I]`` (gate first, then up, as MergedColumnParallelLinear packs them) → ``[T, I]``."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_and_mul takes a [T, 2I] tensor with a contiguous last dim, got {tuple(gate_up.shape)}")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4, **pdl_launch(gate_up),
    )
    return out
