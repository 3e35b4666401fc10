"""Benchmark section ``quant_engines``: quantized targets end to end (issue 21), random weights drawn on
the GPU in each format (tandem/models/random_weights.py; only config.json written, with its
``quantization_config``), CUDA graphs, in process, each against its own limit: the bytes one decoded
token reads at batch 1 (packed weights and their scales for the quantized matrices, bf16 for the rest,
a float32 router, the chosen and shared experts only) ÷ the measured copy rate.

- the Llama-3.1-8B shape, every linear but the LM head INT4 (compressed-tensors, group 32; ≈ 5.4 GB a
  token) and FP8 (128 x 128 blocks; ≈ 8 GB a token): decode at batch 1 (goal >= 75 % of the limit) and 8;
  on the INT4 one also an EAGLE-3 chain of 3 (a random head) at controlled accept length 4, batch 1,
  beside target-only;
- the DeepSeek-V2-Lite shape and Kimi-K2's dimensions with 4 layers (bench/sections_deepseek.py), only the
  routed experts INT4 as Kimi-K2.5 ships them: decode at batch 1 (goal >= 60 %) and 8.

GPU time ≈ 3-4 minutes on a fresh machine, nearly all of it in the four engine starts: random weights,
graph capture and Triton's first compiles of the INT4 / FP8 GEMV, MLA and fused-MoE kernels at each shape
(≈ 30-60 s each; the bf16 V2-Lite's first start took 56 s, see docs/benchmarks.md), then the drafter's
capture; the decode rows take ≈ 1 s each, the speculation row ≈ 5 s. ``--quick`` decodes fewer tokens;
``--layers`` shortens the 8B and V2-Lite shapes. A case that fails to start or run is reported and the
others still run. ``TANDEM_BENCH_INT4_SCALES=float32`` holds the INT4 scales in float32 (4 bytes each, counted so in
the limit) instead of bf16 as a bf16 checkpoint stores them: the A/B of how the scales are held.

The byte counts and the folders are tested on the CPU (tests/test_bench_quant_engines.py)."""

from __future__ import annotations

import dataclasses
import os
import traceback
from pathlib import Path

from engine_rows import copy_tbps_of, decode_rows, random_weight_engine, speculation_rows
from measure import free_gpu
from models import target_dir, weight_bytes_per_token
from quant_schemes import ROUTED_ONLY, fp8_bytes, fp8_config, int4_bytes, int4_config
from sections_deepseek import KIMI_K2_4L, V2_LITE, active_weight_bytes, deepseek_dir
from tandem.models.random_checkpoint import LLAMA_8B, LlamaShape

DENSE_GOAL, MOE_GOAL, ACCEPT_GOAL = 0.75, 0.60, 4.0
INT4_SCALES = os.environ.get("TANDEM_BENCH_INT4_SCALES", "bfloat16")
SCALE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}.get(INT4_SCALES)
if SCALE_BYTES is None:
    raise SystemExit(f"TANDEM_BENCH_INT4_SCALES={INT4_SCALES}: want bfloat16, float16 or float32")
SCALES_TAG = "" if INT4_SCALES == "bfloat16" else f"-{INT4_SCALES}-scales"
LLAMA_SCHEMES = {"int4": (lambda: int4_config(scale_dtype=INT4_SCALES), lambda: int4_bytes(scale_bytes=SCALE_BYTES)),
                 "fp8": (fp8_config, fp8_bytes)}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    path: Path
    weight_bytes: int  # read per token at batch 1
    goal: float  # of the limit at batch 1
    speculate: bool


def llama_case(scheme: str, shape: LlamaShape = LLAMA_8B, name: str = "llama8b") -> Case:
    """The Llama ``shape`` with every linear but the LM head in ``scheme`` ("int4" or "fp8")."""
    config, matrix_bytes = LLAMA_SCHEMES[scheme]
    tag = SCALES_TAG if scheme == "int4" else ""
    path = target_dir(shape.num_layers, shape, f"{name}-{scheme}{tag}", extra={"quantization_config": config()})
    weight_bytes = weight_bytes_per_token(dataclasses.asdict(shape), shape.num_layers, linear=matrix_bytes())
    return Case(f"{name} {scheme}", path, weight_bytes, DENSE_GOAL, scheme == "int4")


def moe_case(name: str, fields: dict) -> Case:
    """A DeepSeek-V3-architecture ``fields`` target with INT4 routed experts (everything else bf16)."""
    quant = int4_config(ignore=ROUTED_ONLY, scale_dtype=INT4_SCALES)
    path = deepseek_dir(f"{name}-{fields['num_hidden_layers']}l-int4{SCALES_TAG}", dict(fields, quantization_config=quant))
    routed = int4_bytes(scale_bytes=SCALE_BYTES)
    return Case(f"{name} int4 experts", path, active_weight_bytes(fields, routed=routed), MOE_GOAL, False)


def cases(layers: int | None = None) -> list[Case]:
    llama = dataclasses.replace(LLAMA_8B, num_layers=layers or LLAMA_8B.num_layers)
    lite = dict(V2_LITE, num_hidden_layers=layers or V2_LITE["num_hidden_layers"])
    return [llama_case("int4", llama), llama_case("fp8", llama), moe_case("v2-lite", lite),
            moe_case("kimi-k2", KIMI_K2_4L)]


def _run_case(case: Case, quick: bool, copy_tbps: float) -> dict:
    widths, batches = ((1, 4) if case.speculate else (1,)), (1, 8)
    engine = random_weight_engine(case.path, widths, max(batches), kv_pages=2048)
    try:
        report = engine.executor.runner.graph_report
        print(f"  graph capture: {report}", flush=True)
        out = {"capture": report,
               "decode": decode_rows(engine, case.weight_bytes, case.goal, batches, 32 if quick else 128, copy_tbps)}
        if case.speculate:
            out["speculation"] = speculation_rows(engine, case.path, (1,), (ACCEPT_GOAL,), 48 if quick else 160)
        return out
    finally:
        engine.shutdown()


def quant_engines(ctx: dict) -> dict:
    """``TANDEM_BENCH_QUANT_CASES``: the cases whose names start with one of these (comma-separated; all by default)."""
    copy_tbps, out = copy_tbps_of(ctx), {}
    wanted = [w for w in os.environ.get("TANDEM_BENCH_QUANT_CASES", "").split(",") if w]
    for case in cases(ctx.get("layers")):
        if wanted and not any(case.name.startswith(w) for w in wanted):
            continue
        print(f"{case.name} ({case.path.name}, {case.weight_bytes / 1e9:.2f} GB read per token at batch 1):",
              flush=True)
        out[case.name] = {"path": str(case.path), "weight_bytes": case.weight_bytes, "goal": case.goal}
        try:
            out[case.name].update(_run_case(case, ctx["quick"], copy_tbps))
        except Exception as e:  # one case's failure (memory, a kernel) must not cost the others' rows
            traceback.print_exc()
            print(f"  failed: {type(e).__name__}: {e}", flush=True)
            out[case.name]["error"] = f"{type(e).__name__}: {e}"
        free_gpu()
    return out
