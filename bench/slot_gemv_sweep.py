"""Which tile streams the mixture-of-experts slot GEMVs fastest on this GPU? A batch-1 decode step of a MoE layer
runs its routed experts (and the shared experts' pieces) slot by slot (tandem/kernels/moe_slots.py): the gate/up
GEMV of every slot, then the down GEMV reading silu(gate) * up. Each slot reads one whole expert, so the step can go
no faster than the slots' bytes ÷ the copy rate: this sweep times both GEMVs alone over a grid of tiles (rows of W,
columns a step, warps, steps in flight, K splits), bf16 and INT4 (group 32) experts, each beside its read limit
measured in the same run and beside the default tile. Timings replay CUDA graphs whose calls route to different
experts (the stacks exceed the L2); a tile counts only where its output equals the default's to bf16 rounding.

    python3 bench/slot_gemv_sweep.py [--shape v2-lite|kimi-k2] [--formats bf16,int4] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, str(Path(__file__).parent))

# (experts incl. shared pieces, slots a token, hidden, expert intermediate)
SHAPES = {"v2-lite": (66, 8, 2048, 1408), "kimi-k2": (385, 9, 7168, 2048)}
# (block_n, block_k, warps, stages, split_k); split_k 0: the default's rule
TILES = [(8, 1024, 4, 1, 0), (4, 1024, 4, 1, 0), (16, 1024, 4, 1, 0), (8, 512, 4, 1, 0), (8, 512, 4, 2, 0),
         (4, 512, 4, 2, 0), (16, 512, 4, 2, 0), (8, 256, 2, 2, 0), (16, 256, 2, 3, 0), (8, 1024, 8, 1, 0),
         (16, 1024, 8, 1, 0), (32, 512, 8, 1, 0), (8, 1024, 4, 1, 2), (16, 512, 4, 2, 2), (32, 256, 4, 2, 0)]


def main() -> None:
    import torch

    from measure import read_seconds
    from quant_schemes import int4_bytes
    from sections import ceilings
    from sections_quant import L2_BYTES, graph_ms
    from tandem.kernels.dequant_configs import DequantConfig, _gemv_split, default_config
    from tandem.kernels.dequant_gemm import slot_linear
    from tandem.kernels.dequant_gemv import gemv_block_k
    from tandem.kernels.dequant_tiles import INT4, PLAIN

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="v2-lite", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="bf16,int4")
    ap.add_argument("--out")
    a = ap.parse_args()
    experts, slots, hidden, inter = SHAPES[a.shape]
    ctx: dict = {}
    ceilings(ctx)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for fmt_name in a.formats.split(","):
        fmt = INT4 if fmt_name == "int4" else PLAIN
        for proj, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
            if fmt == INT4:
                w = torch.randint(-2**31, 2**31 - 1, (experts, n, k // 8), device="cuda", dtype=torch.int32,
                                  generator=gen)
                s = (torch.rand(experts, n, k // 32, device="cuda", generator=gen) * 0.01).bfloat16()
                block, per_expert = (1, 32), int4_bytes()(n, k)
            else:
                w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                s, block, per_expert = None, (1, 1), 2 * n * k
            swiglu = proj == "down"
            x = torch.randn(slots if swiglu else 1, 2 * k if swiglu else k, device="cuda", dtype=torch.bfloat16,
                            generator=gen)
            # calls a graph: enough distinct expert sets that their weights outgrow the L2
            calls = max(4, -(-4 * L2_BYTES // (slots * per_expert)))
            ids = [torch.randperm(experts, device="cuda", generator=gen)[:slots].contiguous() for _ in range(calls)]

            def run(i, cfg):
                return slot_linear(x, w, s, block, fmt, ids[i], n, 1 if swiglu else slots, swiglu=swiglu, config=cfg)

            limit_ms = 1e3 * read_seconds(slots * per_expert, ctx["copy_tbps"])
            default = default_config(1, n, k, x.dtype, fmt=fmt)
            steps = -(-k // gemv_block_k(fmt, block[1], default.block_k))
            default_split = _gemv_split(-(-n // default.block_n) * slots, steps)
            want = run(0, None).float()
            results = []
            for tile in [None] + TILES:
                if tile is None:
                    cfg, name = None, f"default ({default.block_n}, {default.block_k}, {default.num_warps}, " \
                                      f"{default.num_stages}, split {default_split})"
                else:
                    bn, bk, warps, stages, split = tile
                    tile_steps = -(-k // (gemv_block_k(fmt, block[1], bk) or bk))
                    split = split or _gemv_split(-(-n // bn) * slots, tile_steps)
                    cfg, name = DequantConfig(1, bn, bk, num_warps=warps, num_stages=stages, split_k=split,
                                              kernel="gemv"), str(tile[:4] + (split,))
                try:
                    got = run(0, cfg).float()
                except Exception as e:  # noqa: BLE001 (a tile the compiler refuses is reported, not fatal)
                    print(f"{a.shape} {fmt_name} {proj} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                err = ((got - want).norm() / want.norm()).item()
                ms = graph_ms([lambda i=i, cfg=cfg: run(i, cfg) for i in range(calls)])
                results.append((ms, name, err))
                print(f"{a.shape} {fmt_name:4s} {proj:7s} {name:34s}: {1e3 * ms:7.1f} us {100 * limit_ms / ms:5.1f} % "
                      f"of limit ({1e3 * limit_ms:.1f} us), rel err {err:.1e}", flush=True)
                rows.append({"shape": a.shape, "format": fmt_name, "proj": proj, "tile": name, "us": 1e3 * ms,
                             "of_limit": limit_ms / ms, "rel_err": err})
            best = min((r for r in results if r[2] < 1e-2), key=lambda r: r[0])
            print(f"{a.shape} {fmt_name:4s} {proj:7s} BEST {best[1]}: {100 * limit_ms / best[0]:.1f} % of limit "
                  f"(default {100 * limit_ms / results[0][0]:.1f} %)", flush=True)
            w = s = None  # (frees the stacks before the next)
            torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps({"copy_tbps": ctx["copy_tbps"], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
