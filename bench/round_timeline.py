#!/usr/bin/env python3
"""Where a speculative run's device time goes between the graphs: the GPU's idle gaps, by what comes
before and after them.

A chain of 3 at accept length 4 runs close to its graphs' bare replay time (docs/benchmarks.md has the
current share); this says where the rest goes. It profiles one batch-1 request (8B shape, steered to
accept every draft, as the spec section does) with the default settings, and, for comparison, target-only
decoding, and prints for the steady state (the first and last runs left out): the GPU's busy share, its
idle gaps grouped by the operation that ends the gap and the one before it, and the device time per round
by kernel.

    python3 bench/round_timeline.py --out round_timeline.json [--rounds 4] [--new-tokens 160]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from models import LLAMA_8B_SHAPE, bench_drafter, bench_engine  # noqa: E402

RUN_END = "Memcpy DtoH"  # a run's tokens coming back (HostReadback): the marker between runs


def _short(name: str) -> str:
    for cut in ("<", "("):
        name = name.split(cut)[0]
    return name.replace("void ", "").replace("at::native::", "")[:48]


def _device_ops(trace: Path) -> list[dict]:
    events = json.loads(trace.read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(ops, key=lambda e: e["ts"])


def analyse(ops: list[dict], rounds_per_run: int) -> dict:
    """Steady state: from the end of the first run's read-back to the start of the last one's."""
    ends = [i for i, e in enumerate(ops) if e["name"].startswith(RUN_END)]
    if len(ends) < 3:
        return {"error": f"only {len(ends)} runs in the trace"}
    window = ops[ends[0] + 1: ends[-1] + 1]
    runs = len(ends) - 1
    busy, end, gaps = 0.0, window[0]["ts"], collections.defaultdict(lambda: [0, 0.0])
    prev = "(window start)"
    for e in window:
        gap = e["ts"] - end
        if gap > 2.0:
            key = f"{_short(prev)} -> {_short(e['name'])}"
            gaps[key][0] += 1
            gaps[key][1] += gap
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e["name"]
    wall = end - window[0]["ts"]
    per_kernel = collections.defaultdict(float)
    for e in window:
        per_kernel[_short(e["name"])] += e["dur"]
    rounds = runs * rounds_per_run
    return {
        "runs": runs, "wall_ms": wall / 1e3, "busy_ms": busy / 1e3, "busy_share": busy / wall,
        "wall_ms_per_run": wall / 1e3 / runs,
        "idle_us_per_run": (wall - busy) / runs,
        "gaps_us_per_run": sorted(((k, n / runs, us / runs) for k, (n, us) in gaps.items()), key=lambda g: -g[2])[:20],
        "kernel_us_per_round": sorted(((k, us / rounds) for k, us in per_kernel.items()), key=lambda g: -g[1])[:30],
    }


def _profiled(engine, add, rounds_per_run: int, label: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    rid = add()
    engine.step()  # the prefill
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        while not engine.requests[rid].finished:
            engine.step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        ops = _device_ops(path)
    req = engine.requests.pop(rid)
    out = analyse(ops, rounds_per_run)
    out["tok_s_profiled"] = (len(req.output) - 1) / elapsed
    print(f"=== {label}: {out.get('tok_s_profiled', 0):.1f} tok/s under the profiler; "
          f"busy {100 * out.get('busy_share', 0):.1f} %, idle {out.get('idle_us_per_run', 0):.0f} us per run "
          f"of {out.get('wall_ms_per_run', 0):.3f} ms ===", flush=True)
    for key, n, us in out.get("gaps_us_per_run", []):
        print(f"  gap {us:7.1f} us/run ({n:4.1f} x)  {key}", flush=True)
    for key, us in out.get("kernel_us_per_round", [])[:18]:
        print(f"  kernel {us:8.1f} us/round  {key}", flush=True)
    return out


def main() -> None:
    from measure import rate_for
    from tandem.sampling import SamplingParams
    from tandem.speculative.controlled import ControlledAcceptanceProposer
    from tandem.speculative.spec_config import SpecConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="round_timeline.json")
    ap.add_argument("--rounds", default="4", help="rounds per run to profile, e.g. 4,8")
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--layers", type=int, default=LLAMA_8B_SHAPE["num_layers"])
    args = ap.parse_args()

    spec = SpecConfig(3, 1, 4)
    engine = bench_engine(args.layers, widths=(1, spec.num_draft_tokens), max_bs=8)
    drafter, _ = bench_drafter(engine, args.layers, [spec])
    vocab = engine.model_config.vocab_size
    prompt = torch.randint(0, vocab, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True), spec=None)  # JIT warm-up
    report: dict = {"decode": _profiled(engine, lambda: engine.add_request(prompt, greedy, spec=None),
                                        engine.decode_steps, f"target-only, {engine.decode_steps} steps per run")}
    # The verify's own greedy continuation (every draft corrupted), which steered drafts then match exactly.
    steer = ControlledAcceptanceProposer(drafter, 1.0, seed=1)
    engine.proposer, engine.default_spec = steer, spec
    rid = engine.add_request(prompt, greedy)
    steer.set_reference(rid, len(prompt), [0] * (args.new_tokens + 16))
    while not engine.requests[rid].finished:
        engine.step()
    reference = engine.requests.pop(rid).output
    for rounds in (int(r) for r in args.rounds.split(",")):
        engine.spec_rounds = rounds
        proposer = ControlledAcceptanceProposer(drafter, rate_for(4.0, spec.num_steps), seed=1)
        engine.proposer = proposer

        def add():
            rid = engine.add_request(prompt, greedy)
            proposer.set_reference(rid, len(prompt), reference + [0] * 16)
            return rid

        rid = add()  # one unprofiled request first (warm), then the profiled one
        while not engine.requests[rid].finished:
            engine.step()
        engine.requests.pop(rid)
        label = f"chain of 3 at accept 4, {rounds} rounds per run"
        report[f"spec_{rounds}_rounds"] = _profiled(engine, add, rounds, label)
    engine.proposer = None
    engine.shutdown()
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
