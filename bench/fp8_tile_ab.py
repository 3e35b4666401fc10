"""A/B of the FP8 one-row GEMV step on the quantized Llama-3.1-8B shape (the ``quant_engines`` section's folder, random
FP8 block weights, CUDA graphs): batch-1 decode tok/s with the default (1024 columns a step) against 512 columns (the
default before bench/int4_gemv_sweep.py), two engines in one process, interleaved.
    python3 bench/fp8_tile_ab.py [--repeats 3]"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    import torch

    from engine_rows import random_weight_engine
    from measure import interleaved_decode
    from sections_quant_engines import llama_case
    from tandem.kernels import dequant_gemm

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    case = llama_case("fp8")
    engines = {"default (1024)": random_weight_engine(case.path, (1,), 1, 2048)}
    default = dequant_gemm.default_config

    def step_512(m, n, k, dtype=torch.bfloat16, gemv_max_rows=None, fmt=dequant_gemm.INT4, group=None):
        cfg = default(m, n, k, dtype, gemv_max_rows=gemv_max_rows, fmt=fmt, group=group)
        if fmt == dequant_gemm.FP8 and cfg.kernel == "gemv" and cfg.block_k == 1024:
            cfg = dataclasses.replace(cfg, block_k=512, split_k=dequant_gemm._gemv_split(
                -(-n // cfg.block_n) * -(-m // cfg.block_m), -(-k // 512)))
        return cfg

    dequant_gemm.default_config = step_512  # (graphs captured from now on take it)
    engines["512"] = random_weight_engine(case.path, (1,), 1, 2048)
    dequant_gemm.default_config = default
    interleaved_decode(engines, a.repeats, "8B FP8 batch 1")


if __name__ == "__main__":
    main()
