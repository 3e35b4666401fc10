"""Benchmark section ``arrivals``: a closed-loop load in process on an engine built as the verifier builds
it (warm-up included) — the trained demo pair (TANDEM_DEMO_DIR, default: the shipped one) at concurrency 8 and 64, every finished
request replaced at once by the next prompt (tokens/s over a first window, and over as long again once the
policy has learned the load: a server runs for hours), 60–180 new tokens (drawn in the same seeded order for every
mode: real traffic's answers differ in length, and answers of one length would keep target-only's batch in
lockstep — every request finishing in the same step, their successors prefilled together — which no
served traffic does), greedy — target-only, the default policy,
speculating always, and a drafter beside a batch whose policy never speculates (what a drafter costs that
never pays: after a second it is detached, tandem.speculative.attachment); → tokens/s and, per kind of step (plain or speculative, its run length, whether it
prefilled, decoded, ran queued on the device), how many, their mean time and the tokens they emitted.
Where the time of a loaded server goes, without the REST front in the way."""

from __future__ import annotations

import collections
import json
import os
import random
import time
from pathlib import Path

SPEC_FLAGS = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


def _step_kind(info) -> str:
    if info is None:
        return "nothing read back"
    return (f"{'spec' if info.speculative else 'plain'} x{info.steps} prefill={bool(info.num_prefill)} "
            f"decode={bool(info.num_decode)} queued={'queue' in info.spans}")


def _closed_loop(engine, prompts: list, concurrency: int, seconds: float) -> dict:
    from tandem.sampling import SamplingParams

    lengths = random.Random(concurrency)

    def params():
        return SamplingParams(temperature=0.0, max_new_tokens=lengths.randint(60, 180), ignore_eos=True)

    for i in range(concurrency):
        engine.add_request(prompts[i % len(prompts)], params())
    sent, tokens, kinds = concurrency, [0, 0], collections.defaultdict(lambda: [0, 0.0, 0])
    started = time.perf_counter()
    while time.perf_counter() - started < 2 * seconds:  # the first window, then as long again (settled)
        t0 = time.perf_counter()
        window = int(t0 - started >= seconds)
        outputs = engine.step()
        kind = kinds[_step_kind(engine.last_step)]
        emitted = sum(len(o.new_token_ids) for o in outputs)
        kind[0], kind[1], kind[2] = kind[0] + 1, kind[1] + time.perf_counter() - t0, kind[2] + emitted
        tokens[window] += emitted
        for o in outputs:
            if o.finish_reason is not None:
                engine.requests.pop(o.rid, None)
                engine.add_request(prompts[sent % len(prompts)], params())
                sent += 1
    elapsed = time.perf_counter() - started
    while engine.has_unfinished():
        for o in engine.step():
            if o.finish_reason is not None:
                engine.requests.pop(o.rid, None)
    steps = {k: {"n": n, "ms_mean": 1e3 * s / n, "tokens": t} for k, (n, s, t) in sorted(kinds.items())}
    return {"tok_s": tokens[0] / seconds, "tok_s_settled": tokens[1] / (elapsed - seconds), "steps": steps,
            "policy": engine.policy.explain(concurrency)}


def arrivals(ctx: dict) -> dict:
    from verifier.__main__ import build_parser
    from verifier.config import VerifierConfig
    from verifier.metrics import VerifierMetrics
    from verifier.engine_build import build_engine

    import torch

    from tandem.training.demo import SHIPPED

    folder = Path(os.environ.get("TANDEM_DEMO_DIR", SHIPPED))
    device, dtype = ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")  # CPU: a smoke run
    from tandem.training.demo_pair import demo_eval_prompts

    saved = folder / "prompts.json"
    prompts = json.loads(saved.read_text()) if saved.is_file() else demo_eval_prompts(str(folder / "target"), 64)
    base = ["--model", str(folder / "target"), "--device", device, "--dtype", dtype, "--kv-pages", "12288"]
    spec = ["--drafter", "in-process", "--draft-model", str(folder / "draft"), *SPEC_FLAGS]
    modes = {"target-only": base, "policy": base + spec, "always": base + spec + ["--speculation-policy", "always"],
             "never-speculating": base + spec,  # a drafter whose policy never speculates: what it costs
             "target-only-eager-prefill": base + ["--prefill-graph-tokens", "0"]}  # (only when asked for)
    # TANDEM_BENCH_ARRIVALS_MODES: a comma-separated subset (default: the first four)
    wanted = os.environ.get("TANDEM_BENCH_ARRIVALS_MODES", "target-only,policy,always,never-speculating").split(",")
    # TANDEM_BENCH_ARRIVALS_CONCURRENCY: the closed loops' concurrencies (default 8,64)
    concurrencies = [int(c) for c in os.environ.get("TANDEM_BENCH_ARRIVALS_CONCURRENCY", "8,64").split(",")]
    seconds = 2.0 if ctx["quick"] else 8.0  # (a detached drafter attaches again after 2, 4, 8 s)
    out = {}
    for mode, argv in ((m, modes[m]) for m in wanted):
        args = build_parser().parse_args(argv)
        engine, _, _ = build_engine(VerifierConfig.from_args(args, args.model), VerifierMetrics())
        if mode == "never-speculating":
            engine.policy.decide = lambda *args, **kwargs: False
        try:
            out[mode] = {c: _closed_loop(engine, prompts, c, seconds) for c in concurrencies}
        finally:
            engine.shutdown()
        for c, r in out[mode].items():
            print(f"{mode:16s} concurrency {c:2d}: {r['tok_s']:8.0f} tok/s in the first {seconds:.0f} s, "
                  f"{r['tok_s_settled']:8.0f} in the next; the policy: {r['policy']}", flush=True)
            for kind, k in r["steps"].items():
                print(f"    {kind:55s} {k['n']:5d} steps, {k['ms_mean']:7.3f} ms, {k['tokens']} tokens", flush=True)
    return out
