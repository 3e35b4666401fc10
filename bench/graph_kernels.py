#!/usr/bin/env python3
"""Where a batch-1 chain round's graph time goes, kernel by kernel.

Replays each graph of a round — the decode graph (for comparison), the width-4 verify, the head's
3-step chain draft and its draft-extend — back to back under the torch profiler, after a steered
speculative run has left real inputs in their static buffers, and prints per graph: its replay time
(CUDA events), the kernels' summed GPU time (the rest is the gaps between them), and its kernels
grouped by name with time and count per replay. The groups show which kernels a faster verify or
draft must change: the four-row GEMMs against the one-row GEMVs, the small kernels between them.

    python3 bench/graph_kernels.py --out graph_kernels.json [--layers 32] [--reps 20]
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

from models import LLAMA_8B_SHAPE, bench_drafter, bench_engine  # noqa: E402
from measure import rate_for  # noqa: E402
from sections import replay_ms, round_graphs  # noqa: E402


def _leave_real_inputs(engine, drafter, spec, new_tokens: int = 48) -> None:
    """A target-only run, then a steered speculative one at accept length 4, so that every graph's
    static inputs hold a real batch-1 state (KV lengths ~180) when replayed."""
    from tandem.sampling import SamplingParams
    from tandem.speculative.controlled import ControlledAcceptanceProposer

    prompt = torch.randint(0, engine.model_config.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    reference = engine.generate([prompt], greedy, spec=None)[0].output_token_ids
    proposer = ControlledAcceptanceProposer(drafter, rate_for(4.0, spec.num_steps), seed=1)
    engine.proposer, engine.default_spec = proposer, spec
    rid = engine.add_request(prompt, greedy)
    proposer.set_reference(rid, len(prompt), reference + [0] * 16)
    while not engine.requests[rid].finished:
        engine.step()
    engine.requests.pop(rid)
    engine.proposer = None


def _kernels_per_replay(graph, reps: int) -> tuple[float, list[tuple[str, float, float]]]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    groups = [(e.key, e.self_device_time_total / reps, e.count / reps) for e in prof.key_averages()
              if e.self_device_time_total > 0]
    groups.sort(key=lambda g: g[1], reverse=True)
    return sum(us for _, us, _ in groups), groups


def main() -> None:
    from tandem.speculative.spec_config import SpecConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="graph_kernels.json")
    ap.add_argument("--layers", type=int, default=LLAMA_8B_SHAPE["num_layers"])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    spec = SpecConfig(3, 1, 4)
    engine = bench_engine(args.layers, widths=(1, spec.num_draft_tokens), max_bs=8)
    drafter, _ = bench_drafter(engine, args.layers, [spec])
    _leave_real_inputs(engine, drafter, spec)
    results = {}
    for name, graph in round_graphs(engine, drafter, [spec]).items():
        ms = replay_ms(graph)
        kernel_us, groups = _kernels_per_replay(graph, args.reps)
        results[name] = {"replay_ms": ms, "kernel_ms": kernel_us / 1e3,
                         "kernels": [{"name": k, "us": round(us, 2), "count": c} for k, us, c in groups]}
        print(f"=== {name}: replay {ms:.3f} ms, kernels {kernel_us / 1e3:.3f} ms "
              f"({sum(c for _, _, c in groups):.0f} launches) ===", flush=True)
        for key, us, count in groups[:22]:
            print(f"  {us:9.1f} us  x{count:5.1f}  {key[:110]}")
    Path(args.out).write_text(json.dumps(results, indent=1))
    engine.shutdown()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
