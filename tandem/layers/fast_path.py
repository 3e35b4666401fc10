"""Whether a layer may use the Triton kernels (tandem.kernels) instead of plain torch ops.

On CUDA tensors, when triton imports, unless TANDEM_DISABLE_TRITON=1 (to compare against the plain
path). CPU tensors always take the plain torch path, which is the reference.

Linear layers send up to ``gemv_max_rows()`` rows to the Triton GEMV (TANDEM_GEMV_MAX_ROWS, default
1: batch-1 decode; 0 keeps every matmul on cuBLAS). Up to 16 rows work, but on the H200 the
several-row kernel makes a width-4 verify slower than cuBLAS overall, so verifies and batched decode
stay on cuBLAS by default, except the weight shapes that tandem/layers/gemv_routes.py routes to a
measured tile. ``set_gemv_max_rows`` lets a benchmark compare both paths in one process; graphs keep
what was in force when they were captured.
"""

from __future__ import annotations

import functools
import os

import torch

# A layer's input RMSNorm applied by the one-row GEMV of its first projection where that GEMV allows
# (tandem/layers/linear.py's norm_gemv_config): one launch a norm fewer at batch-1 decode
FUSE_INPUT_NORMS = True
_gemv_max_rows = min(16, int(os.environ.get("TANDEM_GEMV_MAX_ROWS", "1")))  # the kernel handles 16 rows at most


@functools.cache
def triton_importable() -> bool:
    if os.environ.get("TANDEM_DISABLE_TRITON") == "1":
        return False
    try:
        import tandem.kernels  # noqa: F401
    except Exception:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_importable()


def gemv_max_rows() -> int:
    return _gemv_max_rows


def set_gemv_max_rows(rows: int) -> None:
    from tandem.kernels.gemv import MAX_ROWS

    global _gemv_max_rows
    if not 0 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv rows must be 0..{MAX_ROWS}, got {rows}")
    _gemv_max_rows = rows
