#!/usr/bin/env python3
"""Tandem's GPU benchmark: one script, one table, one JSON file.

    python bench/bench.py --out bench_results.json [--sections ceilings,decode,spec,service] [--quick]

Sections (each prints its rows as it finishes; the JSON holds everything):
  ceilings  device copy bandwidth and bf16 matmul rate, measured here (the roofline inputs)
  decode    target-only decode tokens/s at batch 1, 8, 32, 64 on a Llama-3.1-8B-shaped random bf16
            model (engine end to end, graphs on; batch 1 also graphs off), against the bandwidth limit
            (weight bytes per token / measured copy bandwidth) and the graphed chain of the model's
            weight GEMVs (cuBLAS, fused QKV and gate/up) — the ceiling of any cuBLAS-GEMV engine; and
            the decode family's capture time and memory (buckets 1-64). The other families' capture
            figures are in the spec section (drafter) and the service section's logs (both services)
  spec      speculative decoding at controlled acceptance (BENCHMARK INSTRUMENT: the real head and real
            verification run; the draft's tokens are steered to the target's own greedy continuation,
            corrupted at a chosen rate), chain and tree settings, in process, graphs on and off
  spec_goal the spec section's goal rows alone (chain of 3 at accept length 4, graphs on)
  service   the same through the drafter and verifier services (gRPC + shared-memory ring) vs in process,
            with the round trip split into the drafter's work and the rest (tandem:drafter_round_seconds)
  tp        tensor parallelism on a 70B-shaped model with fewer layers (TP=1 vs all GPUs)
  phases    where a step's time goes: synchronised per-phase times, profiler top kernels and host ops
  demo      the project's trained demo pair end to end (TANDEM_DEMO_DIR=folder with target/ and draft/)
  overlap   chain rounds at batch 1 and 8: the next run queued before the last is read back, or not
  decode_overlap  the same for plain decode steps at batch 1 and 64
  round_glue  a queued chain round's glue between its graphs: three Triton kernels against torch ops
  quant_kernels  W4A16 / FP8 block linear kernels (GEMV and GEMM rows) vs cuBLAS bf16 and the read limit;
            the fused MoE (INT4 and bf16 Kimi experts, batch 1/8/64) vs the reference loop
  mla       the Triton MLA kernel (Kimi latent, 8 and 64 heads) at batch 1/8/64, kv 1k/4k/8k, decode and
            verify 4, vs the torch MLA backend and the latent read limit
  prefix    the prefix cache: TTFT of a request sharing a 4k-token prefix against the first's, and
            multi-turn prefix-heavy traffic (16 chats x 8 turns on a 1k system prompt) with and without it
  quant_engines  quantized targets end to end, decode at batch 1 and 8 against each one's read limit: the
            8B shape INT4 and FP8, V2-Lite and Kimi-K2 (4 layers) with INT4 routed experts; chain of 3 at
            accept length 4 on the INT4 8B
All models have random weights (nothing can be downloaded); acceptance is set by the experiment.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from section_index import SECTIONS  # noqa: E402


def environment() -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(), "torch": torch.__version__,
           "command": " ".join([Path(sys.executable).name, *sys.argv])}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
    for name in ("triton", "flashinfer", "grpc"):
        try:
            env[name] = __import__(name).__version__
        except Exception:
            env[name] = None
    return env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_results.json")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--quick", action="store_true", help="fewer tokens and settings (a smoke run)")
    p.add_argument("--layers", type=int, default=None, help="override the 8B shape's layer count (smoke runs)")
    args = p.parse_args()
    # (TANDEM_BENCH_DEVICE=cpu: the sections that read it run on the CPU, e.g. rest_demo serving the demo as `tandem up`
    # does on a machine without a GPU)
    if not torch.cuda.is_available() and os.environ.get("TANDEM_BENCH_DEVICE") != "cpu":
        print("bench.py measures GPU performance; no CUDA device is visible (TANDEM_BENCH_DEVICE=cpu: the sections "
              "that read it on the CPU)", file=sys.stderr)
        return 2
    # what an engine in this process decides (detaches, attaches, chain depths) goes into the log beside the figures
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for decisions in ("tandem.engine", "tandem.policy"):
        logging.getLogger(decisions).setLevel(logging.INFO)
    results = {"environment": environment(), "sections": {}}
    print(json.dumps(results["environment"]), flush=True)
    ctx: dict = {"quick": args.quick, "layers": args.layers}
    for name in args.sections.split(","):
        started = time.perf_counter()
        print(f"\n=== {name} ===", flush=True)
        try:
            results["sections"][name] = SECTIONS[name](ctx)
        except Exception as e:  # one broken section must not lose the others' numbers
            import traceback

            traceback.print_exc()
            results["sections"][name] = {"error": f"{type(e).__name__}: {e}"}
        results["sections"][name + "_seconds"] = time.perf_counter() - started
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.exit(main())
