"""Programmatic dependent launch (PDL): let a kernel start while the one before it is still finishing.

A batch-1 decode step is ~300 small kernels in a row; between two of them the GPU drains the first
grid, launches the second and waits for its first loads, a few microseconds each time. Launched with
PDL (Hopper and later), the next grid is scheduled as soon as every program of the current one has
signalled ``launch_dependents``; it then blocks in ``gdc_wait`` until the current grid has completed
and its writes are visible. Work that does not depend on the previous kernel (a GEMV's first weight
tile) can run before the wait, so the gaps between kernels are hidden rather than paid
(docs/benchmarks.md has the current figures).

The rule every kernel of tandem.kernels follows so that ordering stays transitive: with ``PDL`` set,
every program calls ``pdl_enter`` before it reads anything a previous kernel wrote, before it writes
anything, and before any early exit. A kernel that completes has therefore waited for its
predecessor, which waited for its own, and so on; non-PDL kernels (torch, cuBLAS, NCCL) are ordered as
usual. By the same chain, what the kernels before the previous one wrote has completed and been flushed
to L2 before a grid runs (the previous one let it start only after its own wait), so the experts' down
projection reads the routing's ids before its wait, through L2 (``.cg``: CUDA documents the flush as seen
by the waiting grid; an SM's L1 could hold an older line of the same address; tandem/kernels/moe_slots.py).
Only the kernels' own launches carry the attribute, so a torch op between two of them just runs in stream
order.

``TANDEM_DISABLE_PDL=1`` (or ``set_pdl(False)`` before building an engine, for A/B benchmarks)
launches every kernel without it; graphs keep what was in force when they were captured.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_enabled = os.environ.get("TANDEM_DISABLE_PDL") != "1"


def set_pdl(enabled: bool) -> None:
    global _enabled
    _enabled = bool(enabled)


@functools.cache
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def use_pdl(x: torch.Tensor) -> bool:
    """Whether kernels launched for tensor ``x`` should use PDL (never under the interpreter)."""
    if not _enabled or not x.is_cuda or triton.knobs.runtime.interpret:
        return False
    return _supports_pdl(x.device.index if x.device.index is not None else torch.cuda.current_device())


def pdl_launch(x: torch.Tensor, pdl: bool | None = None) -> dict:
    """The two launch arguments that must agree: the kernel's ``PDL`` constexpr (its ``pdl_enter``)
    and Triton's ``launch_pdl`` (the attribute). ``pdl=None``: ``use_pdl(x)`` decides."""
    on = use_pdl(x) if pdl is None else pdl
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous grid (its writes visible), then let the next grid be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
