"""How fast can a batch-1 weight GEMV stream its weight on this GPU? cuBLAS against tandem's Triton
GEMV kernels (tandem/kernels/gemv.py) over a grid of tile configurations, per Llama-3.1-8B weight
shape, then the whole model's chain of GEMVs in one CUDA graph with the best configuration per shape.

Every timing rotates over enough copies of the weight that none is served from the 50 MB L2, and
runs inside a CUDA graph (launch cost as in the engine). A configuration counts only if its output
matches ``F.linear`` to bf16 rounding.

    python bench/gemv_probe.py [--shape llama8b|v2-lite] [--out gemv.json] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics

import torch
import torch.nn.functional as F

from tandem.kernels.gemv import GemvConfig, default_config, gemv

H, I, V, KV = 4096, 14336, 128256, 1024
# (the dense weights a batch-1 token reads, [N, K], and the layers): the 8B's, or DeepSeek-V2-Lite's bf16 ones around
# its routed experts — fused q/kv_a, o, the shared experts' gate/up and down — with its LM head
SHAPE_SETS = {
    "llama8b": ({"qkv": (H + 2 * KV, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I), "lm_head": (V, H)}, 32),
    "v2-lite": ({"qkv": (16 * 192 + 576, 2048), "o": (2048, 2048), "gate_up": (2 * 2816, 2048), "down": (2048, 2816),
                 "lm_head": (102400, 2048)}, 27),
}
SHAPES, LAYERS = SHAPE_SETS["llama8b"]


def graph_ms(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def read_ceiling_tbps() -> float:
    """A plain reduction over 4 GiB: the rate at which this GPU can read memory it does not write."""
    big = torch.randn(1 << 31, device="cuda", dtype=torch.bfloat16)
    acc = torch.empty((), device="cuda", dtype=torch.float32)
    ms = graph_ms(lambda: torch.sum(big, dim=0, dtype=torch.float32, out=acc))
    return big.numel() * 2 / (ms / 1e3) / 1e12


def configs(quick: bool, m: int = 1) -> list[GemvConfig]:
    if m > 1:  # several rows: smaller tiles (the accumulator holds rows x BLOCK_N x BLOCK_K floats)
        rows = [GemvConfig("rows", bn, bk, w) for bn, bk, w in itertools.product((2, 4, 8), (128, 256, 512), (4, 8))
                if m * bn * bk <= 16384]
        dots = [GemvConfig("dot", bn, bk, 4, st) for bn, bk, st in ((32, 256, 5), (64, 128, 3), (32, 128, 3))]
        return rows + dots
    rows = [GemvConfig("rows", bn, bk, w) for bn, bk, w in
            itertools.product((4, 8, 16), (256, 512, 1024), (4, 8))]
    dots = [GemvConfig("dot", bn, bk, 4, st) for bn, bk, st in itertools.product((16, 32, 64), (128, 256), (3, 5))]
    return (rows[::3] + dots[::3]) if quick else rows + dots


def time_shape(n: int, k: int, m: int, cands: list[GemvConfig], pdl: bool = False) -> dict:
    copies = max(2, math.ceil(300e6 / (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, ws[0]).float()
    bytes_per_call = n * k * 2

    def per_call_us(fn) -> float:
        return 1e3 * graph_ms(lambda: [fn(w) for w in ws]) / copies

    cublas = per_call_us(lambda w: torch.matmul(x, w.t(), out=out))
    rows = [{"config": "cublas", "us": cublas, "TBps": bytes_per_call / cublas / 1e6}]
    for cfg in cands:
        try:
            got = gemv(x, ws[0], config=cfg).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            if err > 2e-2:
                rows.append({"config": cfg.__dict__, "error": f"relative error {err:.3g}"})
                continue
            us = per_call_us(lambda w: gemv(x, w, config=cfg, out=out, pdl=pdl))
        except Exception as exc:  # a tile that does not fit in shared memory / registers on this GPU
            rows.append({"config": cfg.__dict__, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        rows.append({"config": cfg.__dict__, "us": us, "TBps": bytes_per_call / us / 1e6})
    ws = None
    torch.cuda.empty_cache()
    return {"n": n, "k": k, "m": m, "rows": rows}


def best(result: dict) -> tuple[GemvConfig | None, float]:
    timed = [r for r in result["rows"] if "us" in r and r["config"] != "cublas"]
    if not timed:
        return None, math.inf
    top = min(timed, key=lambda r: r["us"])
    return GemvConfig(**top["config"]), top["us"]


def chain_tok_s(picks: dict[str, GemvConfig | None], pdl: bool = False, m: int = 1) -> float:
    """The whole model's GEMV chain (32 layers + LM head), one graph; ``None`` picks cuBLAS."""
    mats = [{name: torch.randn(*SHAPES[name], device="cuda", dtype=torch.bfloat16) * 0.02
             for name in ("qkv", "o", "gate_up", "down")} for _ in range(LAYERS)]
    head = torch.randn(*SHAPES["lm_head"], device="cuda", dtype=torch.bfloat16) * 0.02
    hidden, o_in, inner = SHAPES["o"][0], SHAPES["o"][1], SHAPES["down"][1]  # (the shape set's, not the 8B's)
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)

    def lin(name, a, w):
        cfg = picks.get(name)
        return a @ w.t() if cfg is None else gemv(a, w, config=cfg, pdl=pdl)

    def chain():
        y = x
        for layer in mats:
            y = lin("o", lin("qkv", y, layer["qkv"])[:, :o_in], layer["o"])
            y = lin("down", lin("gate_up", y, layer["gate_up"])[:, :inner], layer["down"])
        return lin("lm_head", y, head)

    ms = graph_ms(chain, 20)
    mats = head = None
    torch.cuda.empty_cache()
    return 1e3 / ms


def several_rows(row_counts: list[int]) -> dict:
    """Per row count: the best tile per shape (launched with PDL, as the engine would) against cuBLAS,
    then the model's chain at that many rows, cuBLAS against the picks with PDL."""
    out = {}
    for m in row_counts:
        picks, shapes = {}, {}
        for name, (n, k) in SHAPES.items():
            res = time_shape(n, k, m, configs(False, m), pdl=True)
            cfg, us = best(res)
            cub = res["rows"][0]["us"]
            shapes[name] = res
            picks[name] = cfg
            print(f"m={m} {name:8s} cuBLAS {cub:7.1f} us; best with PDL {us:7.1f} us {cfg}", flush=True)
        cublas, ours = chain_tok_s({}, m=m), chain_tok_s(picks, pdl=True, m=m)
        print(f"m={m} chain: cuBLAS {cublas:.1f} forwards/s, picks with PDL {ours:.1f}", flush=True)
        out[m] = {"shapes": shapes, "picks": {k: v.__dict__ for k, v in picks.items()},
                  "chain_cublas_per_s": cublas, "chain_picks_pdl_per_s": ours}
    return out


def mixed_chains(m: int) -> dict:
    """The model's chain at ``m`` rows with the tensor-core ``dot`` kernel on some shapes only (the ones
    where it beats cuBLAS alone: o, down, lm_head) and cuBLAS on the rest,
    with and without PDL; every variant in turn, three passes, best kept."""
    dot = default_config(m, 4096, 4096)
    variants = {
        "cublas": ({}, False),
        "dot o,down (PDL)": ({"o": dot, "down": dot}, True),
        "dot o,down,lm_head (PDL)": ({"o": dot, "down": dot, "lm_head": dot}, True),
        "dot o,down,lm_head (no PDL)": ({"o": dot, "down": dot, "lm_head": dot}, False),
        "dot everywhere (PDL)": ({name: dot for name in SHAPES}, True),
    }
    best = {name: 0.0 for name in variants}
    for _ in range(3):
        for name, (picks, pdl) in variants.items():
            best[name] = max(best[name], chain_tok_s(picks, pdl=pdl, m=m))
    for name, per_s in best.items():
        print(f"m={m} chain {name:28s}: {per_s:6.1f} forwards/s ({1e3 / per_s:.3f} ms)", flush=True)
    return {"rows": m, "dot_config": dot.__dict__, "forwards_per_s": best}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--chains-only", action="store_true")
    ap.add_argument("--rows", default=None, help="e.g. 2,4,8: sweep several-row tiles with PDL and time "
                                                  "each row count's chain against cuBLAS")
    ap.add_argument("--mixed-chains", type=int, default=0, help="rows: the model's chain with the dot kernel on "
                                                                 "some shapes and cuBLAS on the rest")
    ap.add_argument("--shape", default="llama8b", choices=sorted(SHAPE_SETS), help="whose weights")
    args = ap.parse_args()
    global SHAPES, LAYERS
    SHAPES, LAYERS = SHAPE_SETS[args.shape]
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape}
    report["read_ceiling_TBps"] = read_ceiling_tbps()
    print(f"read ceiling {report['read_ceiling_TBps']:.2f} TB/s", flush=True)
    if args.mixed_chains:
        report["mixed_chains"] = mixed_chains(args.mixed_chains)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        return
    if args.rows:
        report["several_rows"] = several_rows([int(r) for r in args.rows.split(",")])
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        return
    cands = configs(args.quick)
    picks: dict[str, GemvConfig | None] = {}
    report["shapes"] = {}
    for m in () if args.chains_only else (1, 4):
        for name, (n, k) in SHAPES.items():
            res = time_shape(n, k, m, cands if m == 1 else [c for c in cands if c.kernel == "rows"][::2] + [c for c in cands if c.kernel == "dot"])
            report["shapes"][f"{name}_m{m}"] = res
            cfg, us = best(res)
            cub = res["rows"][0]["us"]
            print(f"m={m} {name:8s} [{n}x{k}] cuBLAS {cub:7.1f} us ({res['rows'][0]['TBps']:.2f} TB/s); "
                  f"best {us:7.1f} us ({n * k * 2 / us / 1e6:.2f} TB/s) {cfg}", flush=True)
            if m == 1:
                picks[name] = cfg if us < cub else None
    report["picks"] = {k: (v.__dict__ if v else "cublas") for k, v in picks.items()}
    report["chain_cublas_tok_s"] = chain_tok_s({})
    report["chain_best_tok_s"] = chain_tok_s(picks)
    rows_only = {name: GemvConfig("rows", 4, 1024 if name in ("qkv", "gate_up", "lm_head") else 512, 4)
                 for name in SHAPES}
    report["chain_rows_tok_s"] = chain_tok_s(rows_only)
    report["chain_rows_pdl_tok_s"] = chain_tok_s(rows_only, pdl=True)
    print(f"chain: cuBLAS {report['chain_cublas_tok_s']:.1f} tok/s, best picks {report['chain_best_tok_s']:.1f}, "
          f"rows kernel {report['chain_rows_tok_s']:.1f}, rows kernel with PDL {report['chain_rows_pdl_tok_s']:.1f}",
          flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
