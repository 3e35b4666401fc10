"""A/B of the quantized one-row GEMV's weight steps in flight (tandem/kernels/dequant_gemv.py, ``AHEAD`` =
``DequantConfig.num_stages - 1``) in whole engines: batch-1 decode tok/s of the 8B shape with INT4 or FP8 weights
(random, CUDA graphs) as the default tiles leave it (one step read before the PDL wait) against one-row GEMVs that
read up to ``--ahead`` steps before it — the whole slice of a K = 4096 matrix, while the kernel before still runs.
Interleaved passes, both engines in one process (graphs keep the tiles they were captured with).

    python3 bench/dequant_steps_ahead.py [--cases "llama8b int4,llama8b fp8"] [--ahead 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, str(Path(__file__).parent))


def steps_ahead(ahead: int) -> None:
    """One-row GEMVs captured from now on keep up to ``ahead`` weight steps in flight (at most their K steps less
    one): tandem.kernels.dequant_gemm asks its ``default_config`` at each call, graph capture included."""
    import triton

    from tandem.kernels import dequant_gemm

    default = dequant_gemm.default_config

    def config(m, n, k, *args, **kwargs):
        cfg = default(m, n, k, *args, **kwargs)
        if m == 1 and cfg.kernel == "gemv":
            steps = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k)
            cfg = dataclasses.replace(cfg, num_stages=1 + max(1, min(ahead, steps - 1)))
        return cfg

    dequant_gemm.default_config = config


def main() -> None:
    from engine_rows import copy_tbps_of, random_weight_engine
    from measure import free_gpu, interleaved_decode, read_seconds
    from sections_quant_engines import cases

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="llama8b int4,llama8b fp8")
    ap.add_argument("--ahead", type=int, default=3, choices=(1, 2, 3))  # (the kernel holds at most 3 steps ahead)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    wanted = a.cases.split(",")
    from tandem.kernels import dequant_gemm

    default, copy_tbps = dequant_gemm.default_config, copy_tbps_of({"quick": True})
    for case in cases():
        if case.name not in wanted:
            continue
        dequant_gemm.default_config = default
        engines = {"default": random_weight_engine(case.path, (1,), 1, 256)}
        steps_ahead(a.ahead)
        engines[f"{a.ahead} ahead"] = random_weight_engine(case.path, (1,), 1, 256)
        rates = interleaved_decode(engines, a.repeats, case.name)
        limit = 1 / read_seconds(case.weight_bytes, copy_tbps)
        for name, r in rates.items():
            print(f"{case.name}, {name}: best {max(r) / limit:.1%} of the limit {limit:.0f} tok/s ({copy_tbps:.2f} TB/s)")
        for engine in engines.values():
            engine.shutdown()
        free_gpu()


if __name__ == "__main__":
    main()
