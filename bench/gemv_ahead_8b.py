"""A/B of GemvConfig.prefetch_steps on the Llama-3.1-8B shape (random bf16 weights, CUDA graphs): batch-1
decode tok/s with the default (the first weight tile read before the PDL wait) against one-row GEMVs with
K <= --max-k reading their whole slice first (bench/profile_deepseek.py --gemv-ahead-k), interleaved.
    python3 bench/gemv_ahead_8b.py [--max-k 4096] [--repeats 3]"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    from measure import interleaved_decode
    from models import LLAMA_8B_SHAPE, target_dir
    from engine_rows import random_weight_engine
    from profile_deepseek import read_ahead

    ap = argparse.ArgumentParser()
    ap.add_argument("--max-k", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    path = target_dir(LLAMA_8B_SHAPE["num_layers"])
    engines = {"default": random_weight_engine(path, (1,), 1, 256)}
    read_ahead(a.max_k)  # (graphs captured from now on read ahead)
    engines[f"ahead<={a.max_k}"] = random_weight_engine(path, (1,), 1, 256)
    interleaved_decode(engines, a.repeats, "8B batch 1")


if __name__ == "__main__":
    main()
