"""What the one-row quantized GEMV (tandem/kernels/dequant_gemv.py) does around its products so that a dense
decoder layer's small kernels need no launch of their own at batch-1 decode: ``GemvEnds``.

* **paired** (a gate/up projection): each program owns ``BLOCK_N / 2`` gate rows and the up rows ``pair_offset``
  further, and writes ``silu(gate) * up`` instead of the two products (the activation kernel's launch spared).
* **summed** (the layer's last projection, o or down, at one rank): the product is added to the residual stream and
  the sum written as the new stream, with each program's sum of its squares (float32, one a program) — the norm
  that follows needs the whole row's mean square, which no one program has. The stream it adds to is read while
  the launch before finishes (it never wrote it: the layer's stream is older than its last projection's input).
* **prenormed** (the projection that reads that norm's output): the activations are RMSNorm of the summed stream,
  its mean square read from those sums (a fixed tree over them: the same bits every run), each column normalised
  as it is read (the norm kernel's launch spared).

The roundings are the unfused route's (tandem/kernels/norm.py, activation.py): the products rounded to the
activation dtype before they are added, activated or normalised. Only the mean square is summed in another
order than the norm kernel's (an ulp of rsqrt at most). The layers decide where these apply
(tandem/layers/linear.py: one row, a one-row GEMV without K splits, one rank for a summed product).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels.activation import load_f32, normalised
from tandem.kernels.rounding import round_to


@dataclass(frozen=True)
class GemvEnds:
    pair_offset: int = 0  # paired: the up rows' offset from their gate rows (the output holds pair_offset columns)
    # summed: [1, N], the stream the product is added to. Read before the PDL wait, as the weights are: it must have
    # been written two launches back or earlier (tandem/kernels/pdl.py), never by the launch just before
    residual: torch.Tensor | None = None
    squares_out: torch.Tensor | None = None  # summed: [programs] float32, each program's sum of squares
    squares_in: torch.Tensor | None = None  # prenormed: the summed stream's (x's) sums of squares
    norm_weight: torch.Tensor | None = None  # prenormed: [K], the RMSNorm's weight
    eps: float = 0.0  # prenormed: the RMSNorm's

    @property
    def summed(self) -> bool:
        return self.residual is not None

    @property
    def prenormed(self) -> bool:
        return self.norm_weight is not None

    def kernel_args(self, x: torch.Tensor) -> dict:
        """The GEMV kernel's arguments for these ends (x where an end is off: never read)."""
        squares = self.squares_out if self.summed else self.squares_in if self.prenormed else x
        return dict(r_ptr=self.residual if self.summed else x, g_ptr=self.norm_weight if self.prenormed else x,
                    sq_ptr=squares, eps=self.eps, pair_offset=self.pair_offset,
                    n_squares=squares.numel() if self.prenormed else 0, PAIRED=self.pair_offset > 0,
                    SUMMED=self.summed, SQUARES=triton.next_power_of_2(squares.numel()) if self.prenormed else 0)


@triton.jit
def paired_rows(BLOCK_N: tl.constexpr, pair_offset):
    """A paired program's rows from its first gate row: ``BLOCK_N / 2`` gate rows, then as many up rows
    ``pair_offset`` further."""
    local = tl.arange(0, BLOCK_N)
    return tl.where(local < BLOCK_N // 2, local, local - BLOCK_N // 2 + pair_offset)


@triton.jit
def stream_inv(sq_ptr, n_squares, K: tl.constexpr, eps, SQUARES: tl.constexpr):
    """rsqrt(mean square + eps) of a summed stream of K columns from its programs' sums of squares."""
    sums = tl.load(sq_ptr + tl.arange(0, SQUARES), mask=tl.arange(0, SQUARES) < n_squares, other=0.0)
    return tl.math.rsqrt(tl.sum(sums) / K + eps)


@triton.jit
def prenormed_load(x_ptrs, g_ptrs, mask, inv, DTYPE: tl.constexpr):
    """RMSNorm's output at these columns of a summed stream ``x`` (``inv``: stream_inv)."""
    return normalised(load_f32(x_ptrs, mask), g_ptrs, mask, inv, DTYPE)


@triton.jit
def store_paired(y_ptr, y, row, M, n0, pair_offset, stride_ym, BLOCK_N: tl.constexpr):
    """``silu(gate) * up`` of a paired program's products ``y`` ([BLOCK_N]: its gate rows, then its up rows; bias
    added), each rounded to y's dtype first as the unfused projection stores them."""
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    gate, up = tl.split(tl.permute(tl.reshape(round_to(y, dtype), [2, BLOCK_N // 2]), [1, 0]))
    act = round_to(round_to(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)
    cols = n0 + tl.arange(0, BLOCK_N // 2)
    tl.store(y_ptr + row.to(tl.int64) * stride_ym + cols, act.to(dtype), mask=(cols < pair_offset) & (row < M))


@triton.jit
def store_summed(y_ptr, y, offs_n, N, residual, sq_ptr, pid):
    """The product ``y`` ([BLOCK_N], one row) rounded, added to the residual stream's columns ``residual`` and
    rounded again (norm.py's sum), stored as the new stream at ``y_ptr``, and the program's sum of its squares at
    ``sq_ptr + pid``."""
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    ok = offs_n < N
    stream = round_to(round_to(y, dtype) + residual, dtype)
    tl.store(y_ptr + offs_n, stream.to(dtype), mask=ok)
    tl.store(sq_ptr + pid, tl.sum(tl.where(ok, stream * stream, 0.0)))
