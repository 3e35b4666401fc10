"""A decoder layer's ``(h, residual)`` pair where ``h`` is already the residual stream: the GEMV that produced it
added its product to the stream in its own launch (tandem/kernels/gemv_ends.py's summed end), so ``residual`` is
a ``SummedStream`` carrying that GEMV's sums of squares, which the next RMSNorm's mean square is read from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SummedStream:
    squares: torch.Tensor  # [programs] float32: the producing GEMV's programs' sums of squares of the stream


def norm_input(h: torch.Tensor, residual, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm's output, the stream)`` of a layer's ``(h, residual)`` pair, summed or not."""
    if isinstance(residual, SummedStream):
        return norm(h), h
    return norm(h, residual)


def full_stream(h: torch.Tensor, residual) -> torch.Tensor:
    """The residual stream of a ``(h, residual)`` pair (``residual`` None: the first layer's input, h itself)."""
    return h if residual is None or isinstance(residual, SummedStream) else h + residual
