"""Speculative-decoding evaluation of a (target, EAGLE-3 draft) pair with the in-process engine.

On held-out prompts: mean accept length (tokens per verify round, bonus included: 1 + accepted
drafts / rounds, summed over requests so that each round weighs the same) and per-position
acceptance (of the rounds whose chain reached depth d, the fraction accepting the depth-d token), at
each temperature; then decoding speed at batch 1, with and without speculation, at temperature 0.
Greedy speculative output equals plain greedy output (the engine is lossless), so the speed
comparison generates the same tokens both ways. The engine's speculation policy (which turns
speculation off for requests where it does not pay) is disabled: every round speculates, so the
numbers describe the draft, not the policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tandem.training.progress import note


# A fixed KV pool (64 K tokens in pages of 16) for the engines training and evaluation build: ample
# for their batches, and several engines fit on one GPU (the default sizes the pool to 85 % of it).
KV_PAGES = 4097


@dataclass(frozen=True)
class EvalConfig:
    num_steps: int = 5  # --speculative-num-steps
    topk: int = 1  # --speculative-eagle-topk
    num_draft_tokens: int = 6  # --speculative-num-draft-tokens
    max_new_tokens: int = 96
    temperatures: tuple[float, ...] = (0.0, 1.0)
    speed_prompts: int = 8  # prompts decoded one at a time for tokens/s (0: no timing)
    seed: int = 0
    device: str = "cpu"
    tp_size: int = 1


def _aggregate(results) -> dict:
    rounds = sum(r.spec_stats.rounds for r in results)
    accepted = sum(sum(r.spec_stats.accepted_per_round) for r in results)
    depth = max((len(r.spec_stats.drafted_at_depth) for r in results), default=0)
    drafted_at = [sum(r.spec_stats.drafted_at_depth[d] for r in results if d < len(r.spec_stats.drafted_at_depth)) for d in range(depth)]
    accepted_at = [sum(r.spec_stats.accepted_at_depth[d] for r in results if d < len(r.spec_stats.accepted_at_depth)) for d in range(depth)]
    return {
        "requests": len(results),
        "rounds": rounds,
        "tokens": sum(len(r.output_token_ids) for r in results),
        "accept_length_mean": 1.0 + accepted / rounds if rounds else 1.0,
        "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at)],
    }


def _speed(engine, prompts, params, spec) -> dict:
    engine.generate([prompts[0]], params, spec=spec)  # warm-up (first-call allocations)
    tokens, started = 0, time.perf_counter()
    for p in prompts:
        tokens += len(engine.generate([p], params, spec=spec)[0].output_token_ids)
    elapsed = time.perf_counter() - started
    return {"tokens": tokens, "seconds": round(elapsed, 3), "tokens_per_s": tokens / elapsed if elapsed else 0.0}


def evaluate_pair(target_dir: str, draft_dir: str, prompts: list[list[int]], cfg: EvalConfig = EvalConfig()) -> dict:
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.sampling import SamplingParams
    from tandem.speculative.spec_config import SpecConfig
    from tandem.speculative.policy import PolicyConfig, SpeculationPolicy
    from tandem.engine.speculative_setup import speculative_engine

    spec = SpecConfig(num_steps=cfg.num_steps, topk=cfg.topk, num_draft_tokens=cfg.num_draft_tokens)
    engine_cfg = EngineConfig(model=target_dir, device=cfg.device, tp_size=cfg.tp_size, kv_pages=KV_PAGES)
    report: dict = {"spec": {"num_steps": cfg.num_steps, "topk": cfg.topk, "num_draft_tokens": cfg.num_draft_tokens},
                    "max_new_tokens": cfg.max_new_tokens, "prompts": len(prompts), "by_temperature": {}}
    always = SpeculationPolicy(PolicyConfig(enabled=False))
    with speculative_engine(engine_cfg, draft_dir, spec, policy=always) as engine:  # graphs on GPU
        for temp in cfg.temperatures:
            note(f"evaluating acceptance at temperature {temp:g} on {len(prompts)} held-out prompts")
            params = [SamplingParams(temperature=temp, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + i)
                      for i in range(len(prompts))]
            report["by_temperature"][f"{temp:g}"] = _aggregate(engine.generate(prompts, params))
        speed_prompts = prompts[: cfg.speed_prompts]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=cfg.max_new_tokens)
        if speed_prompts:
            note(f"timing batch-1 decoding of {len(speed_prompts)} prompts with and without speculation")
            report["speed_spec"] = _speed(engine, speed_prompts, greedy, spec)
    if speed_prompts:
        with LLMEngine(engine_cfg) as plain:  # no drafter at all: nothing captured, nothing drafted
            report["speed_plain"] = _speed(plain, speed_prompts, greedy, None)
        report["speedup"] = report["speed_spec"]["tokens_per_s"] / max(1e-9, report["speed_plain"]["tokens_per_s"])
    return report


def format_report(report: dict) -> str:
    spec = report["spec"]
    lines = [f"speculative decoding: chain/tree num_steps={spec['num_steps']} topk={spec['topk']} "
             f"num_draft_tokens={spec['num_draft_tokens']}, {report['prompts']} held-out prompts, "
             f"{report['max_new_tokens']} new tokens each"]
    for temp, agg in report["by_temperature"].items():
        if not agg["rounds"]:  # (every response ended before a round: nothing measured)
            lines.append(f"  T={temp}: accept length n/a (no speculative round: the responses ended at once)")
            continue
        pos = " ".join(f"{a:.2f}" for a in agg["acceptance_by_position"])
        lines.append(f"  T={temp}: accept length {agg['accept_length_mean']:.3f} over {agg['rounds']} rounds; "
                     f"acceptance by position [{pos}]")
    if "speed_spec" not in report:
        return "\n".join(lines)
    s, p = report["speed_spec"], report["speed_plain"]
    lines.append(f"  batch-1 speed (T=0): {s['tokens_per_s']:.1f} tok/s with speculation, {p['tokens_per_s']:.1f} tok/s "
                 f"without ({report['speedup']:.2f}x)")
    return "\n".join(lines)
