"""Benchmark section ``batch``: speculation at batch 1, 8, 32 and 64, in process — target-only, speculating
always and the default (measured) policy, at controlled accept length 1 (every draft wrong: a useless
head), 2, 3 and 4, chain of 3, 8B shape, each cell's three settings interleaved (two passes, best kept).

BENCHMARK INSTRUMENT (controlled acceptance, see the spec section): the real head drafts and the real
verify checks; the chain's tokens are steered to the target's greedy continuation (computed first with
every draft corrupted). The target's greedy continuation has wide margins (bench/models.py,
``sharpen_greedy``), so the policy's plain steps and shorter chains, whose kernels round differently in
bf16, reproduce it too; each row records whether they did and the accept length reached.

Rates are output tokens per second after every request's first token (the prefill's step)."""

from __future__ import annotations

import copy
import os
import time

import torch

from models import LLAMA_8B_SHAPE, bench_drafter, bench_engine
from measure import free_gpu, rate_for
from sections_overlap import _steered_batch

BATCHES = tuple(int(b) for b in os.environ.get("TANDEM_BENCH_BATCHES", "1,8,32,64").split(","))
GOALS = tuple(float(t) for t in os.environ.get("TANDEM_BENCH_GOALS", "1,2,3,4").split(","))


class StepLog:
    """The policy's view of each decode step of a run: (verify width or None, steps, ms per step or None, resumed,
    wall ms). The policy hears of a decode step as the next one starts, so the time between two such calls is the
    earlier step's wall time, also where the policy is told none (a step around a change of depth) — plus any steps
    of prompts alone between them, which it does not hear of (a batch of 32 or 64 prompts takes several)."""

    def __init__(self, policy):
        self.steps, real, last = [], policy.observe_step, [None]

        def observe(n, speculative, steps=1, seconds=None, resumed=False, width=None):
            now = time.perf_counter()
            wall = None if last[0] is None else round(1e3 * (now - last[0]), 1)
            last[0] = now
            self.steps.append((width if speculative else None, steps,
                               None if seconds is None else round(1e3 * seconds / steps, 2), resumed, wall))
            real(n, speculative, steps, seconds, resumed, width)

        policy.observe_step = observe

    def summary(self) -> str:
        kinds = {}
        for width, steps, ms, resumed, wall in self.steps:
            key = "resume" if resumed else f"{f'spec {width} wide' if width else 'plain'} x{steps}"
            kinds.setdefault(key, []).append((ms, wall))

        def median(values):
            timed = sorted(m for m in values if m is not None)
            return timed[len(timed) // 2] if timed else None

        def slowest(values):
            walls = [w for _, w in values if w is not None]
            return f" (slowest {max(walls)} ms wall)" if walls else ""

        return "; ".join(f"{k}: {len(v)} steps, median {median(m for m, _ in v)} ms{slowest(v)}"
                         for k, v in sorted(kinds.items()))


def _target_only(engine, prompts, params) -> float:
    proposer, engine.proposer = engine.proposer, None  # the target alone: no features kept for anyone
    try:
        rids = [engine.add_request(p, params, spec=None) for p in prompts]
        engine.step()
        first_at, first = time.perf_counter(), sum(len(engine.requests[r].output) for r in rids)
        while engine.has_unfinished():
            engine.step()
        tokens = sum(len(engine.requests.pop(r).output) for r in rids) - first
        return tokens / (time.perf_counter() - first_at)
    finally:
        engine.proposer = proposer


def batch(ctx: dict) -> dict:
    from tandem.engine.speculative_setup import verify_widths
    from tandem.engine.warmup import warm_up
    from tandem.sampling import SamplingParams
    from tandem.speculative.spec_config import SpecConfig
    from tandem.speculative.policy import SpeculationPolicy

    layers = ctx.get("layers") or LLAMA_8B_SHAPE["num_layers"]
    new_tokens = 48 if ctx["quick"] else 192
    batches = (1, 8) if ctx["quick"] else BATCHES
    spec = SpecConfig(3, 1, 4)
    chains = SpeculationPolicy().ladder(spec)  # the measured policy may shorten the chain at batch: graphs for each
    engine = bench_engine(layers, widths=verify_widths(chains), max_bs=max(batches))
    drafter, capture = bench_drafter(engine, layers, list(chains), max_bs=max(batches))
    always = engine.policy  # bench_engine's: speculation at every step (the configured chain)
    engine.proposer, engine.default_spec, engine.policy = drafter, spec, SpeculationPolicy()
    took = warm_up(engine)  # what a service runs before SERVING: compiles, and seeds the measured policy's costs
    from tandem.kernels.compile_watch import watch_compiles

    watch_compiles()  # (as the verifier: a kernel first compiled in a measured run is logged)
    seeded = engine.policy
    costs = {n: (seeded.step_time(n, False), seeded.step_time(n, True)) for n in batches}
    print(f"warm-up {took}; seeded step times (plain, round) in ms: "
          + ", ".join(f"bs {n}: {1e3 * p:.2f}, {1e3 * s:.2f}" for n, (p, s) in costs.items() if p and s), flush=True)
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(max_new_tokens=24, ignore_eos=True)  # a few runs of queued rounds
    rows = []
    for bs in batches:
        prompts = [torch.randint(0, vocab, (128,), generator=g).tolist() for _ in range(bs)]
        engine.policy = always
        reference, _, _ = _steered_batch(engine, drafter, spec, prompts, params, 1.0, [[0]] * bs)
        for chain in chains[:-1]:  # the warm-up ran the real head's kernels: the instrument's steered ones at each
            _steered_batch(engine, drafter, chain, prompts, warm, 1.0, reference)  # shorter chain, before any cell
        for goal in GOALS:
            rate = 1.0 if goal == 1.0 else rate_for(goal, spec.num_steps)
            best = {"target_only": 0.0, "always": 0.0, "policy": 0.0}
            accept, same = {"always": 0.0, "policy": 0.0}, {"always": True, "policy": True}
            passes = {name: [] for name in best}  # every pass's tok/s (the row reports the best)
            for _ in range(2):
                passes["target_only"].append(_target_only(engine, prompts, params))
                best["target_only"] = max(best["target_only"], passes["target_only"][-1])
                for name in ("always", "policy"):
                    # The policy of a server that has run before: the step costs it measured so far stay,
                    # what it learned of earlier texts' acceptance goes.
                    engine.policy = always if name == "always" else copy.deepcopy(seeded)
                    engine.policy.forget_traffic()
                    log = StepLog(engine.policy)
                    outputs, tok_s, tau = _steered_batch(engine, drafter, spec, prompts, params, rate, reference)
                    del engine.policy.observe_step  # the instance's wrapper goes: the class's method again
                    print(f"  {name} steps: {log.summary()}", flush=True)
                    if name == "policy":
                        seeded = engine.policy
                        learned = [seeded.step_time(bs, k == "spec", k == "resume") for k in ("plain", "spec", "resume")]
                    passes[name].append(tok_s)
                    if tok_s > best[name]:
                        best[name], accept[name] = tok_s, tau
                    same[name] &= outputs == reference
            row = {"batch": bs, "goal_accept_length": goal, **{f"{k}_tok_s": v for k, v in best.items()},
                   **{f"{k}_accept_length": v for k, v in accept.items()},
                   **{f"{k}_same_as_verify_reference": v for k, v in same.items()},
                   "always_x": best["always"] / best["target_only"], "policy_x": best["policy"] / best["target_only"],
                   "policy_vs_better": best["policy"] / max(best["always"], best["target_only"]),
                   # τ reached differs between the modes (where a round starts among the corrupted positions
                   # depends on the plain steps before it): the policy's rate at always's τ, ÷ the better
                   "policy_vs_better_at_equal_tau": best["policy"] * (accept["always"] / accept["policy"] if accept["policy"] else 1.0)
                   / max(best["always"], best["target_only"]),
                   "policy_step_ms": {k: 1e3 * t if t else None for k, t in zip(("plain", "round", "resume"), learned)},
                   "passes_tok_s": passes}
            rows.append(row)
            print(f"batch {bs:3d} goal τ {goal:.0f}: target-only {best['target_only']:8.1f} tok/s; always "
                  f"{best['always']:8.1f} ({row['always_x']:.2f}x, τ {accept['always']:.2f}); policy "
                  f"{best['policy']:8.1f} ({row['policy_x']:.2f}x, τ {accept['policy']:.2f}) = "
                  f"{row['policy_vs_better']:.3f} of the better ({row['policy_vs_better_at_equal_tau']:.3f} at equal τ); same tokens as the verify reference: "
                  f"always {same['always']}, policy {same['policy']}; policy's step times (ms) "
                  f"{row['policy_step_ms']}; passes (tok/s) "
                  + ", ".join(f"{k} {' / '.join(f'{v:.0f}' for v in vs)}" for k, vs in passes.items()), flush=True)
    engine.proposer = None
    engine.shutdown()
    del engine, drafter
    free_gpu()
    return {"rows": rows, "drafter_capture": capture, "warmup_s": took,
            "seeded_step_ms": {n: [1e3 * t if t else None for t in c] for n, c in costs.items()}}
