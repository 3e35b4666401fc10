"""Which part of the measured policy costs speculation its pace where speculating always is best: the demo pair
(or TANDEM_DEMO_DIR) in process, a closed loop of BATCH requests (120 new tokens, greedy), engines that differ only in
the policy: speculating always, the default policy, and the default without shorter chains (no chain-depth weighing,
one chain's graphs), without measured goodput (the cost model alone) or without measuring plain steps again. Passes interleaved; tok/s, engine steps and
host ms per step, and with --profile the host functions whose time per step differs most from always's.

    python3 bench/policy_parts.py [--device cuda] [--batch 1] [--seconds 6] [--passes 3] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
from pathlib import Path

from detached_plain import closed_loop

MODES = {"always": dict(enabled=False), "policy": {}, "no-shorter-chains": dict(shorter_chains=False),
         "no-goodput": dict(goodput=False),
         # the default without its measurements of plain: no plain probes, goodput's other mode measured once a day
         "no-plain-measuring": dict(plain_probe_every=1 << 30, goodput_explore_max_s=86400.0, goodput_explore_cost=1e-9)}


def _per_step_functions(prof: cProfile.Profile, steps: int) -> dict[str, float]:
    """Microseconds per engine step by tandem function (own time)."""
    out = {}
    for (file, line, fn), (_, _, own, _, _) in pstats.Stats(prof).stats.items():
        if "/tandem/" in file:
            key = f"{file.split('/tandem/')[-1]}:{fn}"
            out[key] = out.get(key, 0.0) + 1e6 * own / max(steps, 1)
    return out


def main() -> None:
    from tandem.engine.config import EngineConfig
    from tandem.engine.speculative_setup import speculative_engine
    from tandem.engine.warmup import warm_up
    from tandem.speculative.policy import PolicyConfig, SpeculationPolicy
    from tandem.speculative.spec_config import SpecConfig
    from tandem.training.demo import SHIPPED
    from tandem.training.demo_pair import demo_eval_prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    folder = Path(os.environ.get("TANDEM_DEMO_DIR", SHIPPED))
    prompts = demo_eval_prompts(str(folder / "target"), 64)
    cfg = EngineConfig(model=str(folder / "target"), device=a.device,
                       dtype="bfloat16" if a.device.startswith("cuda") else "float32", kv_pages=4096)
    engines = {}
    for name in a.modes.split(","):
        engines[name] = speculative_engine(cfg, str(folder / "draft"), SpecConfig(3, 1, 4),
                                           policy=SpeculationPolicy(PolicyConfig(**MODES[name])))
        if engines[name].executor.runner.graphs is not None:  # (as the verifier: timed before serving)
            warm_up(engines[name])
    results = {name: [] for name in engines}
    for rep in range(a.passes):
        for name, engine in (engines.items() if rep % 2 == 0 else reversed(engines.items())):
            r = closed_loop(engine, prompts, a.batch, a.seconds)
            results[name].append(r["tok_s"])
            print(f"pass {rep} {name:18s} batch {a.batch}: {r['tok_s']:8.1f} tok/s, {r['steps']} steps, "
                  f"{r['ms_per_step']:.3f} ms host per step", flush=True)
    for name, rates in results.items():
        print(f"{name:18s} batch {a.batch}: mean {sum(rates) / len(rates):8.1f} tok/s  ({', '.join(f'{x:.0f}' for x in rates)})")
    if a.profile:
        per = {}
        for name, engine in engines.items():
            prof = cProfile.Profile()
            prof.enable()
            r = closed_loop(engine, prompts, a.batch, a.seconds)
            prof.disable()
            per[name] = _per_step_functions(prof, r["steps"])
            print(f"profiled {name}: {r['tok_s']:.1f} tok/s, {r['steps']} steps (profiler on)")
        base = per.get("always", {})
        for name, funcs in per.items():
            if name == "always":
                continue
            diff = sorted(((funcs.get(k, 0.0) - base.get(k, 0.0), k) for k in set(funcs) | set(base)), reverse=True)
            print(f"--- {name} minus always: host µs per step, own time, largest differences ---")
            for d, k in diff[:20]:
                print(f"  {d:+8.1f}  {k}  ({funcs.get(k, 0.0):.1f} vs {base.get(k, 0.0):.1f})")
            print(f"  total over tandem functions: {sum(funcs.values()):.0f} vs {sum(base.values()):.0f} µs per step")


if __name__ == "__main__":
    main()
