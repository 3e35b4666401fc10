"""Benchmark section ``quant_kernels``: the quantized linear kernels and the fused MoE, each against its
bandwidth limit and the plain alternative, on random weights.

* W4A16 (INT4 group 32) and W8A16 (FP8 128 x 128 blocks) at 1 and 4 rows (decode / verify GEMV) and 64
  and 256 rows (GEMM), on Kimi-K2.5 expert shapes, a TP 8 shard (a shared expert's gate/up: few output
  rows, where the default tiles split K) and the Llama-3.1-8B MLP, against the bf16 cuBLAS
  product of the same shape and the read limit: bytes of the packed weight and its scales ÷ 4.8 TB/s
  (H200 peak; the measured copy rate when the ceilings section ran first is shown beside it). Each
  timing replays a CUDA graph of calls that rotate through enough weight copies to miss the 50 MB L2.
  For 1 and 4 rows on three of the shapes a few tiles are tried (for one row also the CUDA-core ``rows``
  kernel) and the best shown next to the default. Up to 4 rows the default is the ``gemv`` kernel
  (tandem/kernels/dequant_gemv.py); the tiles it replaced (``old default``) are timed beside it, and on
  the swept shapes a few ``gemv`` tiles too (``best gemv``). INT4 at 1, 4 and 16 rows also times the
  tensor-core ``mma`` kernel (tandem/kernels/dequant_mma.py, the INT4 default at 5-16 rows below 64 Mi weights: ``mma``, and on the swept
  shapes ``best mma`` over MMA_TILES). ``TANDEM_BENCH_QUANT_ROWS`` (``1,4,16,64,256``) picks the rows.
* The MoE layer's fused path (tandem/kernels/fused_moe.py) against its reference loop at batch 1, 8 and
  64, Kimi expert shapes (hidden 7168, intermediate 2048, top-8) with INT4 experts (384 of them, also
  their TP 8 share: intermediate 256) and bf16 experts (64), against the read limit of the experts the
  batch touches; for INT4 at batch 1 and 8 a few tiles are tried besides the default. On the GPU the loop runs
  each chosen expert's linears through the same kernels as a dense layer (W4A16 for INT4, cuBLAS for
  bf16), one expert after another, with the routing read on the host. The default at batch 1 and 8 goes slot
  by slot (tandem/kernels/moe_slots.py; bf16 experts up to PLAIN_SLOTS_MAX slots); the tiles tried are the grouped
  GEMM's. At batch 1 and 8 both routes are also timed whichever the default takes (``slots_ms``, ``grouped_ms``):
  what moe_slots.SLOTS_MAX and PLAIN_SLOTS_MAX are tuned on.
"""

from __future__ import annotations

import os

import torch

from measure import events_ms, free_gpu, read_seconds
from quant_schemes import int4_bytes

DEVICE = "cuda"  # (tests/test_bench_quant_smoke.py runs the section on the CPU at tiny shapes)
PEAK_TBPS = 4.8
L2_BYTES = 50 << 20
LINEAR_SHAPES = {"kimi expert gate_up": (4096, 7168), "kimi expert down": (7168, 2048),
                 "TP8 shared gate_up": (512, 7168), "8B gate_up": (28672, 4096), "8B down": (4096, 14336)}
ROWS = tuple(int(r) for r in os.environ.get("TANDEM_BENCH_QUANT_ROWS", "1,4,16,64,256").split(","))
MMA_ROWS = (1, 4, 16)  # INT4 rows the tensor-core "mma" kernel is timed at (its tile and MMA_TILES on SWEPT shapes)
# besides mma_config's: (block_m, block_n, block_k, warps): a step of 128, x padded to 8 (mma.sync), 128 rows of W
# (a step of 512 spills)
MMA_TILES = [(16, 64, 128, 4), (8, 64, 256, 4), (16, 128, 256, 8)]
GEMV_TILES = [(16, 32, 128, 4, 4), (16, 16, 512, 4, 3), (16, 32, 256, 4, 4), (16, 64, 128, 4, 4),
              (16, 16, 256, 4, 4, 2)]  # besides the default; the last splits K in two
ROW_TILES = [(1, 4, 512, 4, 3, 1, "rows"), (1, 8, 512, 4, 3, 1, "rows"), (1, 4, 1024, 4, 3, 1, "rows")]  # one row
# the gemv kernel's tiles (after block_m, which is the rows): block_n, block_k, warps, stages, split
GEMV_PATH_TILES = [(8, 1024, 4, 1, 1), (8, 512, 4, 1, 1), (16, 1024, 4, 1, 1), (4, 1024, 4, 1, 1),
                   (8, 2048, 8, 1, 1), (16, 1024, 4, 1, 2), (8, 1024, 4, 1, 2)]
SWEPT = ("kimi expert gate_up", "TP8 shared gate_up", "8B down")  # GEMV tiles swept here (a compile per K)
MOE_HIDDEN, MOE_TOP_K, MOE_BATCHES = 7168, 8, (1, 8, 64)
MOE_CASES = ((384, 2048, True), (384, 256, True), (64, 2048, False))  # (experts, intermediate, INT4)
MOE_TILES = [(16, 32, 128, 4, 3), (16, 64, 128, 4, 3), (16, 16, 256, 4, 3)]  # INT4 at batch <= 8, besides the default


def graph_ms(calls, reps: int = 10) -> float:
    """GPU time per call of a graph that makes ``calls`` (a list of closures) once each (warmed up, which
    compiles the kernels, on a side stream as graph capture wants)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    ms = events_ms(lambda: [g.replay() for _ in range(reps)], 5) / reps
    return ms / len(calls)


def _copies(nbytes: int) -> int:
    return max(2, -(-4 * L2_BYTES // max(nbytes, 1)))


def _weights(n: int, k: int, copies: int) -> dict:
    int4 = [(torch.randint(-2**31, 2**31 - 1, (n, k // 8), device=DEVICE, dtype=torch.int32),
             (torch.rand(n, k // 32, device=DEVICE) * 0.01).bfloat16()) for _ in range(copies)]  # scales as stored
    fp8 = [((torch.randn(n, k, device=DEVICE) * 50).to(torch.float8_e4m3fn),
            torch.rand(-(-n // 128), -(-k // 128), device=DEVICE) * 1e-3) for _ in range(copies)]
    bf16 = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    return {"int4": int4, "fp8": fp8, "bf16": bf16}


def linear_rows(ctx: dict) -> list[dict]:
    from tandem.kernels.dequant_configs import DequantConfig, default_config, mma_config
    from tandem.kernels.dequant_gemm import fp8_block_linear, int4_linear
    from tandem.kernels.dequant_tiles import FP8, INT4

    copy_tbps = ctx.get("copy_tbps")
    rows_out = []
    for label, (n, k) in LINEAR_SHAPES.items():
        nbytes = {"int4": int4_bytes()(n, k), "fp8": n * k + 4 * -(-n // 128) * -(-k // 128),
                  "bf16": 2 * n * k}
        w = _weights(n, k, _copies(nbytes["int4"]))
        for m in ROWS:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            cublas = graph_ms([lambda wb=wb: x @ wb.t() for wb in w["bf16"]])

            def run(fmt, cfg):
                if fmt == "int4":
                    return graph_ms([lambda p=p, s=s: int4_linear(x, p, s, 32, config=cfg) for p, s in w["int4"]])
                return graph_ms([lambda q=q, s=s: fp8_block_linear(x, q, s, (128, 128), config=cfg)
                                 for q, s in w["fp8"]])

            for fmt in ("int4", "fp8"):
                code = INT4 if fmt == "int4" else FP8
                default = default_config(m, n, k, fmt=code, group=32 if fmt == "int4" else None)
                old = default_config(m, n, k, gemv_max_rows=0, fmt=code)
                ms = run(fmt, default)
                old_ms = run(fmt, old) if old != default else ms
                best, best_tile = min((ms, default), (old_ms, old), key=lambda t: t[0])
                gemv_best, gemv_tile = (ms, default) if default.kernel == "gemv" else (None, None)
                if m <= 4 and label in SWEPT:
                    for tile in GEMV_TILES + (ROW_TILES if m == 1 else []):
                        cfg = DequantConfig(*tile)
                        if cfg not in (default, old) and (t := run(fmt, cfg)) < best:
                            best, best_tile = t, cfg
                    for tile in GEMV_PATH_TILES:
                        cfg = DequantConfig(m, *tile, kernel="gemv")
                        if cfg == default or (m > 1 and cfg.block_n > 8):  # several rows: 16 spill (FP8)
                            continue
                        t = run(fmt, cfg)
                        if gemv_best is None or t < gemv_best:
                            gemv_best, gemv_tile = t, cfg
                        if t < best:
                            best, best_tile = t, cfg
                mma_ms = mma_best = mma_tile = None
                if fmt == "int4" and m in MMA_ROWS:
                    mma = mma_config(m, n, k)
                    mma_ms = run(fmt, mma) if mma != default else ms
                    mma_best, mma_tile = mma_ms, mma
                    for bm, bn, bk, warps in MMA_TILES if label in SWEPT else []:
                        cfg = DequantConfig(bm, bn, bk, warps, 1, split_k=mma_config(m, n, k, bn, bk).split_k, kernel="mma")
                        if (t := run(fmt, cfg)) < mma_best:
                            mma_best, mma_tile = t, cfg
                    if mma_best < best:
                        best, best_tile = mma_best, mma_tile
                limit_ms = nbytes[fmt] / (PEAK_TBPS * 1e12) * 1e3
                row = {"shape": label, "n": n, "k": k, "rows": m, "format": fmt, "ms": ms,
                       "default_kernel": default.kernel, "old_default_ms": old_ms, "best_gemv_ms": gemv_best,
                       "best_gemv_tile": gemv_tile and gemv_tile.__dict__, "best_ms": best,
                       "best_tile": best_tile.__dict__, "cublas_bf16_ms": cublas,
                       "limit_ms_4.8TBps": limit_ms, "of_limit": limit_ms / best, "default_of_limit": limit_ms / ms,
                       "old_default_of_limit": limit_ms / old_ms, "speedup_vs_bf16": cublas / best,
                       "mma_ms": mma_ms, "mma_of_limit": mma_ms and limit_ms / mma_ms, "best_mma_ms": mma_best,
                       "best_mma_tile": mma_tile and mma_tile.__dict__}
                if copy_tbps:
                    row["limit_ms_measured_copy"] = read_seconds(nbytes[fmt], copy_tbps) * 1e3
                rows_out.append(row)
                gemv = f", best gemv {1e3 * gemv_best:7.1f}" if gemv_best is not None else ""
                if mma_ms is not None:
                    gemv += f", mma {1e3 * mma_ms:7.1f} = {100 * row['mma_of_limit']:5.1f} % (best mma {1e3 * mma_best:7.1f})"
                print(f"{label:20s} {fmt} M={m:3d}: default ({default.kernel}) {1e3 * ms:7.1f} us = "
                      f"{100 * row['default_of_limit']:5.1f} %, old default {1e3 * old_ms:7.1f}{gemv}, best tile "
                      f"{1e3 * best:7.1f}, cuBLAS bf16 {1e3 * cublas:7.1f} us, limit {1e3 * limit_ms:6.1f} us "
                      f"(best = {100 * row['of_limit']:5.1f} %)", flush=True)
        w = None  # frees this shape's weights (the timed lambdas still name them: no del)
        torch.cuda.empty_cache()
    return rows_out


def _moe_layer(experts: int, inter: int, quantized: bool):
    from tandem.models.loader import default_dtype
    from tandem.layers.moe import MoE
    from tandem.configs.deepseek import MoeConfig
    from tandem.configs.quantization import Int4Group, QuantConfig

    cfg = MoeConfig(n_routed_experts=experts, num_experts_per_tok=MOE_TOP_K, n_shared_experts=0,
                    moe_intermediate_size=inter, first_k_dense_replace=0, moe_layer_freq=1, n_group=1, topk_group=1,
                    norm_topk_prob=True, routed_scaling_factor=2.827)
    quant = QuantConfig("compressed-tensors", Int4Group(32)) if quantized else None
    with torch.device(DEVICE), default_dtype(torch.bfloat16):
        moe = MoE(MOE_HIDDEN, cfg, quant, "model.layers.1.mlp.")
    for proj in moe.expert_weights():  # the stacks every expert's parameters view
        if quantized:
            proj.weight.random_(-2**31, 2**31 - 1)
            proj.scale.uniform_(0.001, 0.01)
        else:
            proj.weight.normal_(0, 0.02)
    moe.gate.weight.data.normal_(0, 0.02)
    return moe


def moe_rows() -> list[dict]:
    from tandem.kernels.fused_moe import MoeTiles, fused_moe
    from tandem.kernels.fused_moe import default_config as moe_tiles
    from tandem.kernels.moe_slots import routed_by_slots

    rows_out = []
    for experts, inter, quantized in MOE_CASES:
        moe = _moe_layer(experts, inter, quantized)
        per_expert = 3 * MOE_HIDDEN * inter * (0.5 + 4 / 32 if quantized else 2)
        for batch in MOE_BATCHES:
            x = torch.randn(batch, MOE_HIDDEN, device=DEVICE, dtype=torch.bfloat16)
            weights, ids = moe.gate(x)
            touched = int(ids.unique().numel())
            fused = graph_ms([lambda: moe.routed_fused(x, weights, ids)])
            best, best_tile = fused, "default"
            routes = {}
            if batch <= 8:
                gate_up, down = moe.expert_weights()
                grouped_cfg = moe_tiles(ids.numel(), experts, x.dtype, gate_up.format)
                routes = {"slots_ms": graph_ms([lambda: routed_by_slots(x, gate_up, down, weights, ids)]),
                          "grouped_ms": graph_ms([lambda: fused_moe(x, gate_up, down, weights, ids, grouped_cfg)])}
            if batch <= 8 and quantized:
                gate_up, down = moe.expert_weights()
                for tile in MOE_TILES:
                    cfg = MoeTiles(*tile)
                    t = graph_ms([lambda cfg=cfg: fused_moe(x, gate_up, down, weights, ids, cfg)])
                    if t < best:
                        best, best_tile = t, cfg.__dict__
            reference = events_ms(lambda: moe.routed_reference(x, weights, ids), 3, warmup=1)
            loop_out = moe.routed_reference(x, weights, ids).float()
            rel = ((moe.routed_fused(x, weights, ids).float() - loop_out).norm() / loop_out.norm()).item()
            limit_ms = touched * per_expert / (PEAK_TBPS * 1e12) * 1e3
            row = {"experts": experts, "intermediate": inter, "format": "int4" if quantized else "bf16", "batch": batch,
                   "experts_touched": touched, "fused_ms": fused, "best_ms": best, "best_tile": best_tile,
                   "reference_loop_ms": reference, "limit_ms_4.8TBps": limit_ms, "of_limit": limit_ms / best,
                   "default_of_limit": limit_ms / fused, "speedup_vs_loop": reference / fused, "rel_err_vs_loop": rel,
                   **routes}
            rows_out.append(row)
            print(f"MoE {row['format']} {experts} experts x {inter} batch {batch:2d} ({touched:3d} touched): fused "
                  f"{1e3 * fused:8.1f} us (best tile {1e3 * best:8.1f}), reference loop {1e3 * reference:9.1f} us, "
                  f"limit {1e3 * limit_ms:7.1f} us = {100 * row['of_limit']:5.1f} %, rel err {rel:.1e}"
                  + (f"; slots {1e3 * routes['slots_ms']:8.1f} us, grouped {1e3 * routes['grouped_ms']:8.1f} us"
                     if routes else ""), flush=True)
        moe = None  # frees the experts (the timed lambdas still name the layer: no del)
        free_gpu()
    return rows_out


def quant_kernels(ctx: dict) -> dict:
    """``TANDEM_BENCH_QUANT_PARTS``: which parts run (``linear,moe`` by default)."""
    parts = os.environ.get("TANDEM_BENCH_QUANT_PARTS", "linear,moe").split(",")
    result = {"linear": linear_rows(ctx) if "linear" in parts else [], "moe": moe_rows() if "moe" in parts else []}
    free_gpu()
    return result
