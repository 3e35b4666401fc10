"""What the one-row quantized GEMV (tandem/kernels/dequant_gemv.py) does around its products so that a dense
decoder layer's small kernels need no launch of their own at batch-1 decode: ``GemvEnds``.

* **paired** (a gate/up projection): each program owns ``BLOCK_N / 2`` gate rows and the up rows ``pair_offset``
  further, and writes ``silu(gate) * up`` instead of the two products (the activation kernel's launch spared),
  each product rounded to the activation dtype first and the silu and the product rounded as torch's two ops do.
* **summed** (the layer's last projection, o or down, at one rank): the product, rounded, is added to the residual
  stream and the sum written, rounded, as the new stream (the add the norm kernel made). The stream it adds to is
  read while the launch before finishes (it never wrote it: the layer's stream is older than its last projection's
  input).
* **prenormed** (the projection that reads the norm of such a stream: qkv, gate/up): RMSNorm is linear in the
  stream but for its one scale, so each program multiplies the stream by the norm's weight as it reads it, sums the
  squares of the columns it walks (all of K: one row, K never split) and scales its sums by rsqrt(mean square +
  eps) at the end. The normalised row is never rounded to the activation dtype, as the norm kernel's output is:
  the products differ from that route by its rounding (the CPU tests bound it against LlamaRMSNorm's), and no
  program waits on another's sums.

The layers decide where these apply (tandem/layers/linear.py: one row, a one-row GEMV tile without K splits, one
rank for a summed product).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels.activation import load_f32, swiglu
from tandem.kernels.rounding import round_to


@dataclass(frozen=True)
class GemvEnds:
    pair_offset: int = 0  # paired: the up rows' offset from their gate rows (the output holds pair_offset columns)
    # summed: [1, N], the stream the product is added to. Read before the PDL wait, as the weights are: it must have
    # been written two launches back or earlier (tandem/kernels/pdl.py), never by the launch just before
    residual: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None  # prenormed: [K], the RMSNorm's weight (x is the summed stream)
    eps: float = 0.0  # prenormed: the RMSNorm's

    @property
    def summed(self) -> bool:
        return self.residual is not None

    @property
    def prenormed(self) -> bool:
        return self.norm_weight is not None

    def kernel_args(self, x: torch.Tensor) -> dict:
        """The GEMV kernel's arguments for these ends (x where an end is off: never read)."""
        return dict(r_ptr=self.residual if self.summed else x, g_ptr=self.norm_weight if self.prenormed else x,
                    eps=self.eps, pair_offset=self.pair_offset, PAIRED=self.pair_offset > 0, SUMMED=self.summed,
                    PRENORMED=self.prenormed)


@triton.jit
def paired_rows(BLOCK_N: tl.constexpr, pair_offset):
    """A paired program's rows from its first gate row: ``BLOCK_N / 2`` gate rows, then as many up rows
    ``pair_offset`` further."""
    local = tl.arange(0, BLOCK_N)
    return tl.where(local < BLOCK_N // 2, local, local - BLOCK_N // 2 + pair_offset)


@triton.jit
def prenormed_load(x_ptrs, g_ptrs, mask):
    """The summed stream's columns at ``x_ptrs`` (``[words, 8 or 4]``) times the norm's weight, in float32 (the
    rsqrt comes at the end), and their squares summed by word."""
    x = load_f32(x_ptrs, mask)
    return x * load_f32(g_ptrs, mask), tl.sum(x * x, axis=1)


@triton.jit
def store_paired(y_ptr, y, row, M, n0, pair_offset, stride_ym, BLOCK_N: tl.constexpr):
    """``silu(gate) * up`` of a paired program's products ``y`` ([BLOCK_N]: its gate rows, then its up rows; bias
    added), each rounded to y's dtype first as the unfused projection stores them."""
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    gate, up = tl.split(tl.permute(tl.reshape(round_to(y, dtype), [2, BLOCK_N // 2]), [1, 0]))
    act = swiglu(gate, up, dtype)
    cols = n0 + tl.arange(0, BLOCK_N // 2)
    tl.store(y_ptr + row.to(tl.int64) * stride_ym + cols, act.to(dtype), mask=(cols < pair_offset) & (row < M))


@triton.jit
def store_summed(y_ptr, y, offs_n, N, residual):
    """The product ``y`` ([BLOCK_N], one row) rounded, added to the residual stream's columns ``residual`` and
    rounded again (norm.py's sum), stored as the new stream at ``y_ptr``."""
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    stream = round_to(round_to(y, dtype) + residual, dtype)
    tl.store(y_ptr + offs_n, stream.to(dtype), mask=offs_n < N)
