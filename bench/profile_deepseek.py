#!/usr/bin/env python3
"""Where a batch-1 decode step of the DeepSeek-V2-Lite shape spends its device time, kernel by kernel (``--target``:
also the quantized Llama-3.1-8B shapes of the ``quant_engines`` section, INT4 or FP8).

Builds the V2-Lite-shaped target as the ``deepseek`` section does (random bf16 weights, MLA + MoE; ``v2-lite-int4``:
its routed experts INT4 as the ``quant_engines`` section has them),
warms it up at batch 1, then records decode steps under torch.profiler (CUDA activity only), once on
CUDA graphs and once eagerly (``disable_cuda_graph=True``), and prints and writes per mode: the top
kernels by device time per decoded token (calls per token, µs per token, share of the step), the kernel
launches per token (and per layer), and the device-busy time per token against the wall time per
token. The wall time is taken over the same number of steps without the profiler (its host overhead
would inflate the eager steps); the weight-read floor at ``--copy-tbps`` is printed beside it.

    python3 bench/profile_deepseek.py [--target v2-lite|v2-lite-int4|llama8b-int4|llama8b-fp8] [--layers 27] [--steps 20]
        [--gemv-ahead-k 4096] [--absorb-merge 4] [--prologue-apart] [--norms-apart]
        [--slot-tile 'gate_up:16,1024,4,1,1'] [--no-side-stream] [--shared-slots] [--skip norm,sum_slots,merge,route]
        [--out profile_deepseek.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from measure import decode_tok_s, free_gpu, read_seconds  # noqa: E402
from sections_deepseek import V2_LITE, active_weight_bytes, deepseek_dir  # noqa: E402
from sections_profile import _idle_gaps  # noqa: E402


def _engine(path: Path, graphs: bool):
    """As sections_deepseek._engine builds it (decode graphs only), with graphs on or off."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.speculative.policy import PolicyConfig, SpeculationPolicy

    cfg = EngineConfig(model=str(path), device="cuda", dtype="bfloat16", load_format="random", cuda_graph_widths=(1,),
                       cuda_graph_max_bs=1, disable_cuda_graph=not graphs, kv_pages=2048)
    return LLMEngine(cfg, policy=SpeculationPolicy(PolicyConfig(enabled=False)))


def _decode(engine, rid: str, tokens: int, per_token: list | None = None) -> int:
    """Engine steps of the one request until at least ``tokens`` are decoded → how many were (with graphs a
    step queues several decode steps: tandem.engine.decode_ahead); ``per_token`` gets each step's seconds
    per token (its median ignores a step that compiled a kernel variant, e.g. a new eager split count)."""
    done = 0
    while done < tokens:
        started = time.perf_counter()
        new = sum(len(o.new_token_ids) for o in engine.step() if o.rid == rid)
        if per_token is not None and new:
            per_token.append((time.perf_counter() - started) / new)
        done += new
    return done


def _kernel_table(trace: Path, tokens: int) -> tuple[list[dict], dict]:
    """The trace's kernels grouped by name (µs and calls per token), and the launch and copy counts. Besides each
    kernel's own span (which, launched with PDL, includes its wait for the kernel before), its *exposed* time: how far
    it moved the end of the device's busy time past every earlier op's end — under PDL, the chain's time from its
    predecessor's end to its own. The exposed times sum to the busy time; they say where the step's time goes. Each
    row's ``launch_shapes``: the same by grid (one kernel's launches at different shapes: a GEMV's projections), with
    the median span of one launch."""
    events = [e for e in json.load(open(trace))["traceEvents"] if e.get("ph") == "X"]
    shapes: dict[str, dict[str, list]] = {}  # name -> grid -> [spans, exposed]
    frontier = None
    device_ops = (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    for e in sorted(device_ops, key=lambda e: e["ts"]):
        end = e["ts"] + e["dur"]
        exposed = max(0.0, end - max(e["ts"], frontier)) if frontier is not None else e["dur"]
        frontier = end if frontier is None else max(frontier, end)
        if e.get("cat") == "kernel":
            grids = shapes.setdefault(e["name"], {})
            shape = grids.setdefault(str(e.get("args", {}).get("grid", "?")), [[], 0.0])
            shape[0].append(e["dur"])
            shape[1] += exposed
    rows = []
    for name, grids in shapes.items():
        launches = [{"grid": grid, "calls_per_token": len(spans) / tokens, "us_per_token": sum(spans) / tokens,
                     "median_us": statistics.median(spans), "exposed_us_per_token": exp / tokens}
                    for grid, (spans, exp) in grids.items()]
        launches.sort(key=lambda r: r["us_per_token"], reverse=True)
        rows.append({"name": name, **{k: sum(r[k] for r in launches)
                                      for k in ("calls_per_token", "us_per_token", "exposed_us_per_token")},
                     "launch_shapes": launches})
    rows.sort(key=lambda r: r["us_per_token"], reverse=True)
    counts = {cat: sum(e.get("cat") == cat for e in events) / tokens for cat in ("kernel", "gpu_memcpy", "gpu_memset")}
    return rows, counts


def profile_mode(path: Path, graphs: bool, steps: int, layers: int, top: int, floor_us: float, out_dir: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from tandem.sampling import SamplingParams

    mode = "graphs" if graphs else "eager"
    engine = _engine(path, graphs)
    decode_tok_s(engine, 1, 8)  # warm-up: the first steps compile kernels (and, eagerly, autotune nothing else)
    vocab = engine.model_config.vocab_size
    prompt = torch.randint(0, vocab, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=2 * steps + 64, ignore_eos=True), spec=None)
    engine.step()  # prefill (and the first token) is not decode
    _decode(engine, rid, 8)
    torch.cuda.synchronize()
    started = time.perf_counter()
    per_token: list[float] = []
    wall_tokens = _decode(engine, rid, steps, per_token)  # the wall time, without the profiler's host overhead
    torch.cuda.synchronize()
    wall_us = 1e6 * (time.perf_counter() - started) / wall_tokens
    median_us = 1e6 * statistics.median(per_token)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        tokens = _decode(engine, rid, steps)
        torch.cuda.synchronize()
    while not engine.requests[rid].finished:
        engine.step()
    engine.requests.pop(rid)
    engine.shutdown()
    del engine
    free_gpu()

    trace = out_dir / f"trace-{path.name}-{mode}.json"
    prof.export_chrome_trace(str(trace))
    rows, counts = _kernel_table(trace, tokens)
    span = _idle_gaps(trace, top=0)  # busy: kernels, copies and memsets merged where they overlap
    # PDL kernels (tandem.kernels.pdl) start before their predecessor ends and their time includes that wait:
    # the summed kernel time exceeds the busy time, and a PDL kernel's share is an upper bound.
    busy_us, kernel_us = 1e3 * span["busy_ms"] / tokens, sum(r["us_per_token"] for r in rows)
    for r in rows:
        r["share_of_step"] = r["us_per_token"] / wall_us
    print(f"--- {mode}: {tokens} tokens; {counts['kernel']:.0f} kernels per token ({counts['kernel'] / layers:.1f} per "
          f"layer), {counts['gpu_memcpy']:.1f} copies, {counts['gpu_memset']:.1f} memsets ---")
    print(f"  wall {wall_us:.0f} us/token ({1e6 / wall_us:.0f} tok/s; median step {median_us:.0f}), "
          f"device busy {busy_us:.0f} us/token "
          f"({busy_us / wall_us:.0%}), kernels {kernel_us:.0f} us/token; weight-read floor {floor_us:.0f} us/token "
          f"({floor_us / wall_us:.0%} of the step)")
    if counts["kernel"] < layers:  # a profiler that sees graph launches but not the kernels inside them
        print("  (fewer kernels than layers: this profiler does not see the kernels inside graph replays)")
    print(f"  {'us/tok':>8} {'share':>6} {'exposed':>8} {'calls':>6}  kernel  (exposed: past every earlier op's end)")
    for r in rows[:top]:
        print(f"  {r['us_per_token']:8.1f} {r['share_of_step']:6.1%} {r['exposed_us_per_token']:8.1f} "
              f"{r['calls_per_token']:6.1f}  {r['name'][:100]}")
        for shape in r["launch_shapes"] if len(r["launch_shapes"]) > 1 else ():
            print(f"  {'':8} {'':6} {shape['exposed_us_per_token']:8.1f} {shape['calls_per_token']:6.1f}    grid "
                  f"{shape['grid']}: median {shape['median_us']:.2f} us a launch")
    return {"tokens": tokens, "trace": trace.name, "wall_us_per_token": wall_us,
            "wall_median_us_per_token": median_us, "busy_us_per_token": busy_us,
            "kernel_us_per_token": kernel_us, "kernels_per_token": counts["kernel"],
            "kernels_per_layer": counts["kernel"] / layers, "copies_per_token": counts["gpu_memcpy"],
            "memsets_per_token": counts["gpu_memset"], "distinct_kernels": len(rows), "top_kernels": rows[:top]}


def read_ahead(max_k: int) -> None:
    """One-row GEMVs with K <= ``max_k`` read every weight tile before the PDL wait (an A/B of prefetch_steps:
    the linear layers ask tandem.kernels.gemv.default_config at each call, graph capture included)."""
    import dataclasses

    from tandem.kernels import gemv

    default = gemv.default_config

    def config(rows: int, n: int, k: int):
        cfg = default(rows, n, k)
        if rows == 1 and cfg.kernel == "rows" and k <= max_k:
            cfg = dataclasses.replace(cfg, prefetch_steps=-(-k // cfg.block_k))
        return cfg

    gemv.default_config = config


SKIPPABLE = ("norm", "sum_slots", "merge", "route")


def skip_kernels(names: list[str]) -> None:
    """An upper bound, not a model: the named kernels are not launched (their outputs are left as they were, or, for
    ``route``, the same experts every step), so the step's time says what they cost in the chain at most; the
    tokens are garbage. ``norm``: the decoder's RMS norms launched apart (those inside GEMVs stay: add --norms-apart);
    ``sum_slots``: the MoE slots' weighted sum; ``merge``: the
    latent attention's split merge; ``route``: the noaux routing after the router's logits."""
    from tandem.kernels import fused_moe, mla_attention, moe_route, moe_slots, norm

    if "norm" in names:
        norm.rms_norm = lambda x, weight, eps, residual=None, out=None, residual_out=None: (
            x if residual is None else (x, residual))
    if "sum_slots" in names:
        def first_slot(per_slot, top_k, route_w, add, dtype):
            # the first slot's bits read as ``dtype`` (float32 slots: a view, where a cast would launch a kernel)
            hidden = per_slot.shape[1]
            as_dtype = per_slot.view(dtype)
            return as_dtype.view(-1, top_k, as_dtype.shape[1])[:, 0, :hidden]

        moe_slots.sum_slots = fused_moe.sum_slots = first_slot  # (the grouped path imports it by name)
    if "merge" in names:
        mla_attention.merge_splits = lambda part_o, part_lse, out, pdl: None
    if "route" in names:
        fixed: dict = {}

        def route(logits, bias, n_group, topk_group, k, normalise, scale, extra=0):
            key = (logits.shape[0], k + extra, logits.device)
            if key not in fixed:  # (made by the eager warm-up, before any capture)
                ids = torch.arange(k + extra, device=logits.device).repeat(logits.shape[0], 1)
                ids[:, k:] += logits.shape[1] - k  # the shared experts' slots, as noaux_route places them
                fixed[key] = (torch.full(ids.shape, 1.0 / k, device=logits.device), ids)
            return fixed[key]

        moe_route.noaux_route = route


def slot_tiles(spec: str) -> None:
    """The routed experts' slot GEMVs (tandem/kernels/moe_slots.py) with the given tiles: gate-up (the first GEMV,
    no swiglu) and down (reading silu(gate) * up) apart."""
    from tandem.kernels import moe_slots
    from tandem.kernels.dequant_configs import DequantConfig

    tiles = {}
    for part in spec.split(";"):
        name, numbers = part.split(":")
        bn, bk, warps, stages, split = (int(v) for v in numbers.split(","))
        tiles[name.strip()] = DequantConfig(1, bn, bk, num_warps=warps, num_stages=stages, split_k=split, kernel="gemv")
    original = moe_slots.slot_linear

    def tiled(*args, swiglu=False, **kwargs):
        return original(*args, swiglu=swiglu, config=tiles.get("down" if swiglu else "gate_up"), **kwargs)

    moe_slots.slot_linear = tiled


def quant_tiles(spec: str) -> None:
    """One-row quantized GEMVs of the given [N, K] with the given tiles ('N,K:BN,BK,WARPS,STAGES;...', the split the
    default's): an in-model A/B of bench/int4_gemv_sweep.py's best tiles."""
    import dataclasses

    from tandem.kernels import dequant_gemm
    from tandem.kernels.dequant_configs import default_config

    tiles = {}
    for part in spec.split(";"):
        shape, numbers = part.split(":")
        bn, bk, warps, stages = (int(v) for v in numbers.split(","))
        tiles[tuple(int(v) for v in shape.split(","))] = (bn, bk, warps, stages)

    def config(m, n, k, *args, **kwargs):
        cfg = default_config(m, n, k, *args, **kwargs)
        if m == 1 and cfg.kernel == "gemv" and (n, k) in tiles:
            bn, bk, warps, stages = tiles[n, k]
            cfg = dataclasses.replace(cfg, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
        return cfg

    dequant_gemm.default_config = config


def clamped_read_ahead() -> None:
    """Every GEMV config with its read-ahead clamped (DequantConfig.clamped_read_ahead on): the in-model A/B."""
    import dataclasses

    from tandem.kernels import dequant_gemm

    chosen = dequant_gemm.default_config

    def config(*args, **kwargs):
        return dataclasses.replace(chosen(*args, **kwargs), clamped_read_ahead=True)

    dequant_gemm.default_config = config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="v2-lite", choices=("v2-lite", "v2-lite-int4", "llama8b-int4", "llama8b-fp8"))
    ap.add_argument("--layers", type=int, default=V2_LITE["num_hidden_layers"], help="v2-lite's layers")
    ap.add_argument("--steps", type=int, default=20, help="decoded tokens profiled (and timed) per mode")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per mode")
    ap.add_argument("--modes", default="graphs,eager", help="comma-separated: graphs, eager")
    ap.add_argument("--copy-tbps", type=float, default=4.22, help="the copy rate the read floor assumes (H200: 4.22)")
    ap.add_argument("--gemv-ahead-k", type=int, default=0,
                    help="one-row GEMVs with K up to this read their whole weight slice before the PDL wait "
                         "(GemvConfig.prefetch_steps; 0: the default, the first tile)")
    ap.add_argument("--absorb-merge", type=int, default=0,
                    help="the absorbed output projection merges the latent attention's splits itself, its value rows "
                         "cut into about this many programs a head (mla_absorb.MERGE_SPLITS_HERE; 0: the merge kernel)")
    ap.add_argument("--slot-tile", default="",
                    help="the experts' slot GEMVs take this tile: 'gate_up:BN,BK,WARPS,STAGES,SPLIT;down:...' (either "
                         "part; bench/slot_gemv_sweep.py's tiles; default: dequant_configs.default_config)")
    ap.add_argument("--norms-apart", action="store_true",
                    help="the layers' input norms in their own launches (fast_path.FUSE_INPUT_NORMS off)")
    ap.add_argument("--prologue-apart", action="store_true",
                    help="MLA's prologue in its own launch, not inside absorb_q's "
                         "(mla_absorb.PROLOGUE_IN_ABSORB_Q off)")
    ap.add_argument("--skip", default="",
                    help=f"comma-separated kernels not launched, an upper bound on their cost ({', '.join(SKIPPABLE)})")
    ap.add_argument("--no-side-stream", action="store_true",
                    help="shared experts run in the main stream's chain (side_stream.SIDE_STREAMS off)")
    ap.add_argument("--shared-slots", action="store_true",
                    help="shared experts as routing slots where stored as the routed ones (moe.SHARED_AS_SLOTS on)")
    ap.add_argument("--quant-tile", default="",
                    help="one-row quantized GEMVs of these [N, K] take these tiles: 'N,K:BN,BK,WARPS,STAGES;...'")
    ap.add_argument("--clamped-read-ahead", action="store_true",
                    help="the quantized GEMVs over one K range re-read their last step instead of masking the "
                         "read-ahead (DequantConfig.clamped_read_ahead on everywhere)")
    ap.add_argument("--out", default="profile_deepseek.json")
    args = ap.parse_args()
    skip = [k for k in args.skip.split(",") if k]
    if any(k not in SKIPPABLE for k in skip):
        ap.error(f"--skip takes {', '.join(SKIPPABLE)}; got {args.skip!r}")
    skip_kernels(skip)
    if args.gemv_ahead_k:
        read_ahead(args.gemv_ahead_k)
    # the switches an A/B flips: flag -> (module, setting, value)
    switches = {"no_side_stream": ("tandem.layers.side_stream", "SIDE_STREAMS", False),
                "shared_slots": ("tandem.layers.moe", "SHARED_AS_SLOTS", True),
                "norms_apart": ("tandem.layers.fast_path", "FUSE_INPUT_NORMS", False),
                "prologue_apart": ("tandem.kernels.mla_absorb", "PROLOGUE_IN_ABSORB_Q", False)}
    for flag, (module, setting, value) in switches.items():
        if getattr(args, flag):
            setattr(importlib.import_module(module), setting, value)
    if args.slot_tile:
        slot_tiles(args.slot_tile)
    if args.quant_tile:
        quant_tiles(args.quant_tile)
    if args.clamped_read_ahead:
        clamped_read_ahead()
    if args.absorb_merge:
        from tandem.kernels import mla_absorb

        mla_absorb.MERGE_SPLITS_HERE, mla_absorb.SPLIT_PROGRAMS_PER_HEAD = True, args.absorb_merge
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("graphs", "eager") for m in modes):
        ap.error(f"--modes takes graphs and/or eager, got {args.modes!r}")

    if args.target == "v2-lite":
        fields = dict(V2_LITE, num_hidden_layers=args.layers)
        path = deepseek_dir(f"v2-lite-{args.layers}l", fields)  # the deepseek section's folder: same config
        weight_bytes = active_weight_bytes(fields)
    elif args.target == "v2-lite-int4":  # the quant_engines section's folder: INT4 routed experts, the rest bf16
        from sections_quant_engines import moe_case

        case = moe_case("v2-lite", dict(V2_LITE, num_hidden_layers=args.layers))
        fields, path, weight_bytes = {"case": case.name, "num_hidden_layers": args.layers}, case.path, case.weight_bytes
    else:  # the quant_engines section's folder (its layer count: the 8B shape's 32)
        from sections_quant_engines import llama_case

        case = llama_case(args.target.split("-")[1])
        fields, path, weight_bytes, args.layers = {"case": case.name}, case.path, case.weight_bytes, 32
    floor_us = 1e6 * read_seconds(weight_bytes, args.copy_tbps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{args.target}, {args.layers} layers: {weight_bytes / 1e9:.2f} GB read per token, floor {floor_us:.0f} us/token "
          f"at {args.copy_tbps} TB/s ({1e6 / floor_us:.0f} tok/s)", flush=True)
    result = {"fields": fields, "active_weight_bytes": weight_bytes, "copy_tbps": args.copy_tbps,
              "floor_us_per_token": floor_us, "steps": args.steps, "modes": {}}
    for mode in modes:
        result["modes"][mode] = profile_mode(path, mode == "graphs", args.steps, args.layers, args.top, floor_us,
                                             out.parent)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
