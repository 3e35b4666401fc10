"""Plain decoding with the drafter detached against target-only, in process: the demo pair (or
TANDEM_DEMO_DIR), a closed loop of BATCH requests, 120 new tokens each, greedy. Both engines on the
same device and settings; the speculative one held detached for the whole run, so every step should be a
target-only step ("served-detached": held detached as a served engine is, the policy still deciding and metering every
step); "attached": the speculative engine kept attached but never speculating (what the policy compares
speculation with before it detaches). Prints tok/s and host seconds per engine step; --profile: the top host
functions in the last pass.

    python3 bench/detached_plain.py [--device cuda] [--batch 8] [--seconds 6] [--passes 2] [--profile] [--engines a,b]
"""

from __future__ import annotations

import argparse
import dataclasses
import cProfile
import os
import pstats
import time
from pathlib import Path


def closed_loop(engine, prompts: list[list[int]], batch: int, seconds: float) -> dict:
    from tandem.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    nxt, tokens, steps, host = 0, 0, 0, 0.0
    for _ in range(batch):
        engine.add_request(prompts[nxt % len(prompts)], params)
        nxt += 1
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        outs = engine.step()
        host += time.perf_counter() - t0
        steps += 1
        for o in outs:
            tokens += len(o.new_token_ids)
            if o.finish_reason is not None:
                engine.requests.pop(o.rid, None)  # (as a server forgets them: the engine's table stays small)
                engine.add_request(prompts[nxt % len(prompts)], params)
                nxt += 1
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        for o in engine.step():
            if o.finish_reason is not None:
                engine.requests.pop(o.rid, None)
    return {"tok_s": tokens / elapsed, "steps": steps, "ms_per_step": 1e3 * host / max(steps, 1),
            "tokens_per_step": tokens / max(steps, 1)}


def main() -> None:
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.speculative_setup import speculative_engine
    from tandem.speculative.spec_config import SpecConfig
    from tandem.training.demo import SHIPPED
    from tandem.training.demo_pair import demo_eval_prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--engines", default="target-only,detached,served-detached,attached,features",
                    help="comma-separated, built in this order (a process-wide effect of the drafter shows as "
                         "target-only alone against target-only with the others built)")
    a = ap.parse_args()
    folder = Path(os.environ.get("TANDEM_DEMO_DIR", SHIPPED))
    prompts = demo_eval_prompts(str(folder / "target"), 64)
    cfg = EngineConfig(model=str(folder / "target"), device=a.device,
                       dtype="bfloat16" if a.device.startswith("cuda") else "float32", kv_pages=2048)

    def detached(as_served: bool):  # as served: detached as the policy leaves it, every step still decided and metered
        spec = speculative_engine(cfg, str(folder / "draft"), SpecConfig(3, 1, 4))
        spec.attachment.hold_detached(as_served)
        return spec

    def attached():  # plain steps only, the drafter kept attached: each step's features held for a draft to come
        from tandem.engine.warmup import _Forced

        spec = speculative_engine(cfg, str(folder / "draft"), SpecConfig(3, 1, 4))
        spec.policy = _Forced(spec.policy, False, record=False)
        spec.attachment.pause()  # (never detaches)
        return spec

    builders = {"target-only": lambda: LLMEngine(cfg), "detached": lambda: detached(False),
                "served-detached": lambda: detached(True),
                "attached": attached,
                # target-only whose decode graphs also output the EAGLE-3 features (as a speculative engine's attached
                # steps do)
                "features": lambda: LLMEngine(dataclasses.replace(cfg, graph_decode_features=True))}
    engines = {name: builders[name]() for name in a.engines.split(",")}
    for engine in engines.values():
        closed_loop(engine, prompts, a.batch, 1.0)  # warm-up
    for rep in range(a.passes):
        for name, engine in engines.items():
            prof = cProfile.Profile() if a.profile and rep == a.passes - 1 else None
            if prof:
                prof.enable()
            r = closed_loop(engine, prompts, a.batch, a.seconds)
            if prof:
                prof.disable()
                print(f"--- {name}: host profile (cumulative) ---")
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            print(f"{name:12s} batch {a.batch}: {r['tok_s']:8.1f} tok/s, {r['steps']} steps, "
                  f"{r['ms_per_step']:.3f} ms host per step, {r['tokens_per_step']:.2f} tokens a step", flush=True)


if __name__ == "__main__":
    main()
