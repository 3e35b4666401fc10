"""Whether a layer may use the Triton kernels (tandem.kernels) instead of plain torch ops.

On CUDA tensors, when triton imports, unless TANDEM_DISABLE_TRITON=1 (to compare against the plain
path). CPU tensors always take the plain torch path, which is the reference.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _triton_importable() -> bool:
    if os.environ.get("TANDEM_DISABLE_TRITON") == "1":
        return False
    try:
        import tandem.kernels  # noqa: F401
    except Exception:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton_importable()
