"""Which tile and how many K steps in flight stream a one-row quantized GEMV fastest on this GPU? The GEMV kernel
(tandem/kernels/dequant_gemv.py) over a grid of tiles, and for INT4 the register-fed mma.sync kernel
(tandem/kernels/dequant_mma_sync.py), on the quantized linear shapes of bench/sections_quant.py,
INT4 (group 32) and FP8 (128 x 128 blocks), bf16 activations, each against its read limit in the same run (bytes of
the packed weight and its scales ÷ the measured copy rate) and beside the default tile. Timings replay CUDA graphs
that rotate through weight copies larger than the L2 (sections_quant.graph_ms); a tile counts only if its output
equals the default's to bf16 rounding. ``stages`` = steps of the weight in flight, the one multiplied included.

    python3 bench/int4_gemv_sweep.py [--formats int4,fp8] [--shapes "8B gate_up,8B down"] [--kernels gemv,mma_sync]
                                     [--rows 1,2,3]

``--rows``: rows of x (a batch's decode or a chain's verify width); the GEMV tiles take up to 4, the mma_sync kernel 8.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, str(Path(__file__).parent))

# the 8B's attention projections (N, K), swept on request: small GEMVs a layer's chain waits on
ATTENTION_SHAPES = {"8B qkv": (6144, 4096), "8B o": (4096, 4096)}
# (block_n, block_k, warps, stages): the default's neighbours, deeper pipelines at fewer rows of W a program
TILES = [(8, 1024, 4, 2), (8, 1024, 4, 3), (4, 1024, 4, 2), (4, 1024, 4, 3), (4, 1024, 4, 4), (2, 1024, 4, 4),
         (4, 2048, 4, 2), (4, 2048, 4, 3), (2, 2048, 4, 3), (4, 512, 4, 4), (8, 512, 4, 3), (4, 1024, 8, 3),
         (2, 1024, 8, 4), (4, 2048, 8, 2),
         # 16 rows of W: the activations' unpacking shared by twice the rows (3.10 instructions a weight in the
         # loop's SASS on the 8B down shape, against the default's 3.46; 96 registers)
         (16, 1024, 4, 1), (16, 1024, 4, 3)]
# INT4 only: the register-fed mma.sync kernel (tandem/kernels/dequant_mma_sync.py), rows of W a program, and programs
# wanted as a multiple of PROGRAMS_WANTED (two an H200 SM), K split to reach them
MMA_SYNC_TILES = [("mma_sync", bn, f) for bn in (64, 128) for f in (1, 2, 4)]


def main() -> None:
    import torch

    from sections import ceilings
    from sections_quant import LINEAR_SHAPES, _copies, graph_ms
    from measure import read_seconds
    from quant_schemes import int4_bytes
    from tandem.kernels.dequant_configs import (MMA_SYNC_STEP, PROGRAMS_WANTED, DequantConfig, default_config,
                                                mma_sync_config)
    from tandem.kernels.dequant_gemm import fp8_block_linear, int4_linear
    from tandem.kernels.dequant_tiles import FP8, INT4

    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="int4,fp8")
    shapes = {**LINEAR_SHAPES, **ATTENTION_SHAPES}
    ap.add_argument("--shapes", default=",".join(LINEAR_SHAPES), help=f"of {', '.join(shapes)}")
    ap.add_argument("--kernels", default="gemv,mma_sync", help="the tiles of which kernels beside the default")
    ap.add_argument("--rows", default="1", help="rows of x, comma-separated")
    ap.add_argument("--out")
    a = ap.parse_args()
    ctx: dict = {}
    ceilings(ctx)
    rows = []
    for m, label in [(int(m), label) for m in a.rows.split(",") for label in a.shapes.split(",")]:
        n, k = shapes[label]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for fmt in a.formats.split(","):
            if fmt == "int4":
                nbytes = int4_bytes()(n, k)
                ws = [(torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32),
                       (torch.rand(n, k // 32, device="cuda") * 0.01).bfloat16()) for _ in range(_copies(nbytes))]
                run = lambda p, s, cfg: int4_linear(x, p, s, 32, config=cfg)  # noqa: E731
            else:
                nbytes = n * k + 4 * -(-n // 128) * -(-k // 128)
                ws = [((torch.randn(n, k, device="cuda") * 50).to(torch.float8_e4m3fn),
                       torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-3) for _ in range(_copies(nbytes))]
                run = lambda q, s, cfg: fp8_block_linear(x, q, s, (128, 128), config=cfg)  # noqa: E731
            limit_ms = 1e3 * read_seconds(nbytes, ctx["copy_tbps"])
            default = default_config(m, n, k, fmt=INT4 if fmt == "int4" else FP8, group=32 if fmt == "int4" else None)
            # the GEMV tiles' K split (the default's, where the default is not the GEMV: 4 rows take mma_sync)
            gemv_split = default_config(m, n, k, gemv_max_rows=4, fmt=INT4 if fmt == "int4" else FP8).split_k
            want = run(*ws[0], default).float()
            results = []
            kernels = a.kernels.split(",")
            # "flipped": the default tile with its read-ahead the other way (DequantConfig.clamped_read_ahead)
            tiles = [None] + (["flipped"] if default.kernel == "gemv" else []) + (TILES if "gemv" in kernels else []) \
                + (MMA_SYNC_TILES if fmt == "int4" and "mma_sync" in kernels else [])
            for tile in tiles:
                if tile == "flipped":
                    cfg = dataclasses.replace(default, clamped_read_ahead=not default.clamped_read_ahead)
                elif tile is not None and tile[0] == "mma_sync":
                    split = max(1, min(k // MMA_SYNC_STEP, round(tile[2] * PROGRAMS_WANTED / -(-n // tile[1]))))
                    cfg = mma_sync_config(m, n, k, tile[1], split)
                elif tile is not None and m > 4:
                    continue
                else:
                    cfg = default if tile is None else DequantConfig(m, *tile, split_k=gemv_split, kernel="gemv")
                if tile not in (None, "flipped") and cfg == default:
                    continue
                try:
                    got = run(*ws[0], cfg).float()
                except Exception as e:  # noqa: BLE001 (a tile the compiler refuses is reported, not fatal)
                    print(f"{label} {fmt} {tile}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                err = ((got - want).norm() / want.norm()).item()
                ms = graph_ms([lambda w=w, cfg=cfg: run(*w, cfg) for w in ws])
                results.append((ms, tile, err))
                name = ("default " + str((default.block_n, default.block_k, default.num_warps, default.num_stages))
                        if tile is None else str(tile)) + (" clamped" if cfg.kernel == "gemv" and cfg.clamped_read_ahead
                                                           and tile in (None, "flipped") else "")
                print(f"{label:22s} {m} row {fmt} {name:28s} split {cfg.split_k}: {1e3 * ms:7.1f} us "
                      f"{100 * limit_ms / ms:5.1f} % of limit ({1e3 * limit_ms:.1f} us), rel err {err:.1e}", flush=True)
                rows.append({"shape": label, "rows": m, "format": fmt, "tile": tile or "default", "split": cfg.split_k,
                             "us": 1e3 * ms, "of_limit": limit_ms / ms, "rel_err": err})
            ok = [r for r in results if r[2] < 1e-2]
            best = min(ok, key=lambda r: r[0])
            print(f"{label:22s} {m} row {fmt} BEST {best[1] or 'default'}: {100 * limit_ms / best[0]:.1f} % of limit", flush=True)
            del ws
            torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps({"copy_tbps": ctx["copy_tbps"], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
