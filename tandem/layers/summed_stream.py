"""A decoder layer's ``(h, residual)`` pair where ``h`` is already the residual stream: the GEMV that produced it
added its product to the stream in its own launch (tandem/kernels/gemv_ends.py's summed end), and ``residual`` is a
``SummedStream`` saying so (the next projection may then apply the norm itself: the prenormed end)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SummedStream:
    """The mark of a summed pair (no data: h is the stream)."""


def norm_input(h: torch.Tensor, residual, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm's output, the stream)`` of a layer's ``(h, residual)`` pair, summed or not."""
    if isinstance(residual, SummedStream):
        return norm(h), h
    return norm(h, residual)


def full_stream(h: torch.Tensor, residual) -> torch.Tensor:
    """The residual stream of a ``(h, residual)`` pair (``residual`` None: the first layer's input, h itself)."""
    return h if residual is None or isinstance(residual, SummedStream) else h + residual
