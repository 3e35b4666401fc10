#!/usr/bin/env python3
"""Which kernel should a batch-1 verify's four-row products use, per weight shape?

At batch 1 a width-4 verify multiplies 4 rows by every weight of the target (and the head's
draft-extend 4 rows by the head's): products that, like a decode step's GEMVs, can be no faster than
reading the weight once. cuBLAS reads some of these shapes well below the copy ceiling
(docs/benchmarks.md). This script, on the GPU:

1. times each weight shape at 4 rows with cuBLAS and with tandem's tensor-core GEMV tiles (``dot``,
   software-pipelined), launched back to back with programmatic dependent launch as in the
   engine's graphs, over enough weight copies that none is served from L2; a tile counts only if it
   matches ``F.linear`` to bf16 rounding;
2. picks, per shape, the fastest tile where it beats cuBLAS by ``--margin`` and writes those routes
   (the format ``TANDEM_GEMV_ROUTES`` reads), and the fastest tile of every shape (``--best-out``);
3. times the model's chain of four-row products with cuBLAS against the picks;
4. builds the engine and the head once per routing of ``--graph-variants`` and replays each graph of
   a round at batch 1 (verify, draft, extend; decode for comparison), with the verify's and the
   extend's kernels grouped under the profiler.

    python3 bench/verify_gemms.py --out verify_gemms.json --routes-out routes.json [--layers 32]
    python3 bench/verify_gemms.py --no-sweep --graph-variants cublas=none,default=default,every=best.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from gemv_probe import SHAPES, chain_tok_s, time_shape  # noqa: E402
from models import LLAMA_8B_SHAPE  # noqa: E402

H = LLAMA_8B_SHAPE["hidden_size"]
# the EAGLE-3 head's own shapes (its gate/up, down and o are the target's)
HEAD_SHAPES = {"head_fc": (H, 3 * H), "head_qkv": (H + 2 * 1024, 2 * H), "draft_lm_head": (32000, H)}


def candidates():
    from tandem.kernels.gemv import GemvConfig

    return [GemvConfig("dot", bn, bk, 4, st) for bn, bk, st in
            ((16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 256, 3), (32, 256, 5), (64, 128, 3), (64, 128, 5),
             (32, 128, 6))]


def sweep(rows: int, margin: float) -> tuple[dict, dict, dict]:
    results, picks, bests = {}, {}, {}
    for name, (n, k) in {**SHAPES, **HEAD_SHAPES}.items():
        res = time_shape(n, k, rows, candidates(), pdl=True)
        results[name] = res
        cublas = res["rows"][0]["us"]
        timed = [r for r in res["rows"][1:] if "us" in r]
        best = min(timed, key=lambda r: r["us"]) if timed else None
        if best is not None:
            bests[name] = {"rows": rows, "n": n, "k": k, "config": best["config"]}
        if best is not None and best["us"] < cublas * (1 - margin):
            picks[name] = {**bests[name], "us": best["us"], "cublas_us": cublas}
        print(f"{name:14s} [{n}x{k}] cuBLAS {cublas:7.1f} us ({res['rows'][0]['TBps']:.2f} TB/s); best tile "
              + (f"{best['us']:7.1f} us ({best['TBps']:.2f} TB/s) {best['config']}" if best else "none")
              + ("  <- routed" if name in picks else ""), flush=True)
    return results, picks, bests


def routes_for(spec: str) -> dict:
    """none, default (tandem's), or a routes file."""
    from tandem.layers.gemv_routes import DEFAULT_ROUTES, load_routes

    if spec == "none":
        return {}
    return dict(DEFAULT_ROUTES) if spec == "default" else load_routes(spec)


def engine_graphs(routes: dict, layers: int, reps: int) -> dict:
    """Bare replays of a round's batch-1 graphs with these routes in force at capture."""
    from graph_kernels import _kernels_per_replay, _leave_real_inputs
    from measure import free_gpu
    from models import bench_drafter, bench_engine
    from sections import replay_ms, round_graphs

    from tandem.layers.gemv_routes import set_routes
    from tandem.speculative.spec_config import SpecConfig

    set_routes(routes)
    spec = SpecConfig(3, 1, 4)
    engine = bench_engine(layers, widths=(1, spec.num_draft_tokens), max_bs=8)
    drafter, _ = bench_drafter(engine, layers, [spec])
    _leave_real_inputs(engine, drafter, spec)
    out = {}
    for name, graph in round_graphs(engine, drafter, [spec]).items():
        ms = replay_ms(graph)
        row = {"replay_ms": ms}
        if name.startswith("verify") or name == "draft_extend":
            total, groups = _kernels_per_replay(graph, reps)
            row["kernels_us"] = total
            row["top_groups"] = [(k[:90], round(us, 1), cnt) for k, us, cnt in groups[:12]]
        out[name] = row
        print(f"  {name:20s} replay {ms:.3f} ms", flush=True)
    engine.shutdown()
    del engine, drafter
    free_gpu()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="verify_gemms.json")
    ap.add_argument("--routes-out", default="routes.json")
    ap.add_argument("--best-out", default="best_routes.json", help="the fastest tile of every shape, as routes")
    ap.add_argument("--no-sweep", action="store_true", help="only the engine's graphs")
    ap.add_argument("--graph-variants", default="cublas=none,picks=ROUTES_OUT,every=BEST_OUT",
                    help="name=none|default|FILE,...: the routings to build the engine with")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--margin", type=float, default=0.03, help="route a shape only if its tile beats cuBLAS by this")
    ap.add_argument("--layers", type=int, default=LLAMA_8B_SHAPE["num_layers"])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    from gemv_probe import read_ceiling_tbps

    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": args.rows}
    if not args.no_sweep:
        report["read_ceiling_TBps"] = read_ceiling_tbps()
        print(f"read ceiling {report['read_ceiling_TBps']:.2f} TB/s", flush=True)
        report["shapes"], picks, bests = sweep(args.rows, args.margin)
        Path(args.routes_out).write_text(json.dumps([{k: p[k] for k in ("rows", "n", "k", "config")}
                                                     for p in picks.values()]))
        Path(args.best_out).write_text(json.dumps(list(bests.values())))
        report["picks"], report["bests"] = picks, bests
        from tandem.kernels.gemv import GemvConfig

        chain_picks = {name: GemvConfig(**p["config"]) for name, p in picks.items() if name in SHAPES}
        report["chain_forwards_per_s"] = {"cublas": chain_tok_s({}, m=args.rows),
                                          "picks": chain_tok_s(chain_picks, pdl=True, m=args.rows)}
        print(f"four-row chain of the target's products: {report['chain_forwards_per_s']}", flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    report["graphs"] = {}
    for variant in args.graph_variants.split(","):
        name, spec = variant.split("=", 1)
        spec = {"ROUTES_OUT": args.routes_out, "BEST_OUT": args.best_out}.get(spec, spec)
        print(f"engine graphs, {name} ({spec}):", flush=True)
        report["graphs"][name] = engine_graphs(routes_for(spec), args.layers, args.reps)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
