"""At batch-1 decode, a layer's attention output projection's weights moved into the L2 from the side stream while
the attention's latency-bound kernels run (tandem/kernels/l2_prefetch.py says why). Forked at the layer's start and
joined after the attention: the prefetch writes nothing, so the join orders nothing but the capture (a side stream's
work must join back before a graph capture ends). ``PREFETCH_OUTPUT_WEIGHTS``: off until measured
(bench/profile_deepseek.py ``--l2-prefetch``)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.layers.side_stream import side_stream

PREFETCH_OUTPUT_WEIGHTS = False
MAX_ROWS = 8  # decode batches and short verifies: beyond, the GEMVs are GEMMs that stream their weights well
MIN_BYTES = 1 << 16  # a tensor smaller than this (a bias, scales of a small layer) is left to the GEMV


class Fork:
    """The side stream's prefetch, joined back by ``join`` (nothing to join where nothing was forked)."""

    def __init__(self, side: torch.cuda.Stream | None = None, main: torch.cuda.Stream | None = None):
        self.side, self.main = side, main

    def join(self) -> None:
        if self.side is not None:
            self.main.wait_stream(self.side)


def prefetch_weights(x: torch.Tensor, module: nn.Module) -> Fork:
    """``module``'s parameters read into the L2 on the side stream, forked now, where ``x`` is a decode batch on a
    GPU (side_stream: None on the CPU)."""
    if not PREFETCH_OUTPUT_WEIGHTS or x.shape[0] > MAX_ROWS:
        return Fork()
    side = side_stream(x)
    if side is None:
        return Fork()
    from tandem.kernels.l2_prefetch import prefetch_l2

    main = torch.cuda.current_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for p in module.parameters():
            if p.is_cuda and p.is_contiguous() and p.numel() * p.element_size() >= MIN_BYTES and p.data_ptr() % 16 == 0:
                prefetch_l2(p)
    return Fork(side, main)
