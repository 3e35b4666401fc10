"""Whether a layer may use the Triton kernels (tandem.kernels) instead of plain torch ops.

On CUDA tensors, when triton imports, unless TANDEM_DISABLE_TRITON=1 (to compare against the plain
path). CPU tensors always take the plain torch path, which is the reference.

Linear layers send up to ``gemv_max_rows()`` rows to the Triton GEMV (TANDEM_GEMV_MAX_ROWS, default
1: batch-1 decode; 0 keeps every matmul on cuBLAS). Up to 16 rows work, but on the H200 the
several-row kernel made a width-4 verify slower than cuBLAS (chain of 3 at accept 4: 476-528 against
587 tok/s, docs/benchmarks.md), so verifies and batched decode stay on cuBLAS by default. (Sending only
the attention output and MLP down projections to the tensor-core kernel made the bare 4-row GEMV
chain 3% faster, but the engine's width-4 verify graph 4% slower: 4.77 against 4.59 ms, session of
2026-11-30, fourth.)
``set_gemv_max_rows`` lets a benchmark compare both paths in one process; graphs keep what was in force
when they were captured.

Routes send the products of 2 to 4 rows with one weight shape ``(N, K)`` to one Triton GEMV tile
(``GemvConfig`` fields as a dict), whatever ``gemv_max_rows``: cuBLAS picks few, wide tiles for some
skinny shapes and reads them below the bandwidth (a width-4 verify at batch 1 on the 8B shape: qkv at
3.1 TB/s and o at 2.7, against 4.2 for a copy). The defaults are the shapes where the tensor-core
kernel beat cuBLAS by 3 % or more at 4 rows on the H200 (bench/verify_gemms.py, docs/benchmarks.md);
every other shape stays on cuBLAS. ``TANDEM_GEMV_ROUTES`` names a JSON file of
``[{"n": N, "k": K, "config": {...}}, ...]`` (bench/verify_gemms.py writes one for the shapes it
measures) that replaces them; ``TANDEM_GEMV_ROUTES=none`` routes nothing.
"""

from __future__ import annotations

import functools
import json
import os

import torch

_gemv_max_rows = min(16, int(os.environ.get("TANDEM_GEMV_MAX_ROWS", "1")))  # the kernel handles 16 rows at most


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


def gemv_max_rows() -> int:
    return _gemv_max_rows


_DOT_64 = {"kernel": "dot", "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 5}
_DOT_32 = {"kernel": "dot", "block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 5}
# (N, K) of the Llama-3.1-8B shape and its EAGLE-3 head, measured at 4 rows (2026-12-01, H200):
DEFAULT_SEVERAL_ROWS_ROUTES = {
    (6144, 4096): _DOT_64,  # fused qkv: 15.7 against cuBLAS's 16.2 us
    (4096, 4096): _DOT_32,  # attention output: 11.4 against 12.6 us
    (128256, 4096): _DOT_64,  # LM head: 242 against 250 us
    (4096, 12288): _DOT_32,  # the head's fc over three target layers' features: 28.3 against 30.9 us
}


def _routes_from_env() -> dict[tuple[int, int], dict]:
    path = os.environ.get("TANDEM_GEMV_ROUTES")
    if not path:
        return dict(DEFAULT_SEVERAL_ROWS_ROUTES)
    if path == "none":
        return {}
    with open(path) as f:
        return {(int(r["n"]), int(r["k"])): dict(r["config"]) for r in json.load(f)}


_several_rows_routes: dict[tuple[int, int], dict] = _routes_from_env()


def several_rows_route(n: int, k: int) -> dict | None:
    """The GEMV tile (GemvConfig fields) for 2-4 rows times a weight [n, k], or None for cuBLAS."""
    return _several_rows_routes.get((n, k))


def set_several_rows_routes(routes: dict[tuple[int, int], dict]) -> None:
    """Replace the routes (benchmarks compare them in one process; graphs keep the ones they were
    captured with)."""
    global _several_rows_routes
    _several_rows_routes = {(int(n), int(k)): dict(cfg) for (n, k), cfg in routes.items()}


def set_gemv_max_rows(rows: int) -> None:
    from tandem.kernels.gemv import MAX_ROWS

    global _gemv_max_rows
    if not 0 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv rows must be 0..{MAX_ROWS}, got {rows}")
    _gemv_max_rows = rows
