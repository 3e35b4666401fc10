"""Which Triton GEMV tile serves a product of a few rows with one weight shape, where cuBLAS reads it
slowly.

cuBLAS picks few, wide tiles for some skinny products and streams their weight below the bandwidth:
a width-4 verify at batch 1 on the Llama-3.1-8B shape reads its fused qkv and attention output
weights well below a copy's rate (bench/verify_gemms.py). A route sends the products
of exactly ``rows`` rows with a weight ``[n, k]`` to one tile of tandem/kernels/gemv.py instead
(``GemvConfig`` fields as a dict), which also joins the programmatic dependent launch chain of the
kernels around it. The defaults are the shapes where the tensor-core kernel beats cuBLAS by 3 % or
more at 4 rows on the H200 (docs/benchmarks.md); other shapes and row counts stay on cuBLAS.
``TANDEM_GEMV_ROUTES`` names a JSON file of ``[{"rows": R, "n": N, "k": K, "config": {...}},
...]`` (bench/verify_gemms.py writes one for the shapes it measures; ``rows`` defaults to 4) that
replaces them; ``TANDEM_GEMV_ROUTES=none`` routes nothing. Graphs keep the routes in force when they
were captured.
"""

from __future__ import annotations

import json
import os

_DOT_64 = {"kernel": "dot", "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 5}
_DOT_32 = {"kernel": "dot", "block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 5}
# (rows, N, K) of the Llama-3.1-8B shape and its EAGLE-3 head, at 4 rows:
DEFAULT_ROUTES = {
    (4, 6144, 4096): _DOT_64,  # fused qkv
    (4, 4096, 4096): _DOT_32,  # attention output
    (4, 128256, 4096): _DOT_64,  # LM head
    (4, 4096, 12288): _DOT_32,  # the head's fc over three target layers' features
}


def load_routes(path: str) -> dict[tuple[int, int, int], dict]:
    """A routes file → {(rows, n, k): GemvConfig fields}; a malformed one is a ValueError naming it."""
    try:
        with open(path) as f:
            entries = json.load(f)
        routes = {(int(e.get("rows", 4)), int(e["n"]), int(e["k"])): dict(e["config"]) for e in entries}
        for rows, _, _ in routes:
            if not 2 <= rows <= 16:
                raise ValueError(f"rows must be 2..16 (one row has its own kernel), got {rows}")
        return routes
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"TANDEM_GEMV_ROUTES={path}: expected a JSON list of "
                         f'{{"rows": R, "n": N, "k": K, "config": {{...}}}}, got {type(e).__name__}: {e}') from None


def _from_env() -> dict[tuple[int, int, int], dict]:
    path = os.environ.get("TANDEM_GEMV_ROUTES")
    if not path:
        return dict(DEFAULT_ROUTES)
    return {} if path == "none" else load_routes(path)


_routes: dict[tuple[int, int, int], dict] = _from_env()


def route(rows: int, n: int, k: int) -> dict | None:
    """The GEMV tile for ``rows`` rows times a weight [n, k], or None for cuBLAS."""
    return _routes.get((rows, n, k))


def set_routes(routes: dict[tuple[int, int, int], dict]) -> None:
    """Replace the routes (a benchmark compares several in one process)."""
    global _routes
    _routes = {(int(r), int(n), int(k)): dict(cfg) for (r, n, k), cfg in routes.items()}


def current_routes() -> dict[tuple[int, int, int], dict]:
    return dict(_routes)
