"""Benchmark section ``long_prompt``: a 32k-token prompt arriving while 16 streams decode (8B shape, random
bf16 weights, target only, in process, graphs on), with chunked prefill (the default budget) and without
(``--chunked-prefill-size -1``: the prompt prefilled whole in one step).

The streams' inter-token latency — the gap between two token arrivals of a stream, as a streaming client
sees it (a run of queued steps delivers several tokens at once: one gap, then zeros) — over a window
without the long prompt, then over the window from its arrival until every stream's next token after the
prompt's first (so the gap across the prompt's last step is counted). The goal: p99 with
the prompt <= 2x p99 without it. Also the long prompt's time to first token.

The helper below the section takes any LLMEngine (tests/test_bench_long_prompt.py runs it on a tiny CPU model).
"""

from __future__ import annotations

import random
import statistics
import time

from models import LLAMA_8B_SHAPE, target_dir
from measure import free_gpu

STREAMS, STREAM_PROMPT, LONG_PROMPT, BASELINE_S = 16, 128, 32768, 2.0
ITL_GOAL = 2.0  # p99 with the long prompt / p99 without


def long_prompt(ctx: dict) -> dict:
    from tandem.engine.config import DEFAULT_CHUNKED_PREFILL_SIZE

    layers = ctx.get("layers") or LLAMA_8B_SHAPE["num_layers"]
    long_tokens = 4096 if ctx["quick"] else LONG_PROMPT
    out: dict = {"shape": {**LLAMA_8B_SHAPE, "num_layers": layers}, "long_prompt_tokens": long_tokens}
    for name, chunk in (("chunked", DEFAULT_CHUNKED_PREFILL_SIZE), ("whole", -1)):
        engine = _engine(layers, chunk)
        r = out[name] = itl_around_a_long_prompt(engine, STREAMS, STREAM_PROMPT, long_tokens, BASELINE_S)
        r["chunked_prefill_size"] = chunk
        print(f"{name:8s} (--chunked-prefill-size {chunk}): ITL p99 {1e3 * r['baseline']['p99_s']:.1f} ms without, "
              f"{1e3 * r['during']['p99_s']:.1f} ms during the {long_tokens}-token prompt = {r['p99_ratio']:.2f}x "
              f"(goal <= {ITL_GOAL}x: {'met' if r['p99_ratio'] <= ITL_GOAL else 'NOT met'}); its TTFT "
              f"{r['long_ttft_s']:.2f} s; {len(r['prompt_steps'])} prompt steps (tokens, ms): "
              f"{r['prompt_steps'][:3]} ... {r['prompt_steps'][-3:]}", flush=True)
        engine.shutdown()
        del engine
        free_gpu()
    return out


def _engine(layers: int, chunk: int):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    # a context past the long prompt; 96k tokens of KV: the prompt and the streams' runs
    cfg = EngineConfig(model=str(target_dir(layers, context=2 * LONG_PROMPT)), device="cuda", dtype="bfloat16",
                       load_format="random", cuda_graph_max_bs=STREAMS, kv_pages=6144, chunked_prefill_size=chunk)
    return LLMEngine(cfg)


# -- the helper (any engine) ----------------------------------------------------------------------
def _gaps_summary(gaps: list[float]) -> dict:
    ordered = sorted(gaps)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0
    return {"gaps": len(gaps), "p50_s": statistics.median(ordered) if ordered else 0.0, "p99_s": p99,
            "max_s": ordered[-1] if ordered else 0.0}


def itl_around_a_long_prompt(engine, streams: int, stream_prompt: int, long_tokens: int, baseline_s: float,
                             seed: int = 0) -> dict:
    """``streams`` requests decode; their token gaps over ``baseline_s`` seconds, then from the arrival of a
    ``long_tokens`` prompt (one output token) until every stream has a token after the prompt's first →
    both windows' gap summaries, the p99 ratio and the long prompt's TTFT. The streams are aborted at the end."""
    from tandem.sampling import SamplingParams

    rng, vocab = random.Random(seed), engine.model_config.vocab_size
    endless = SamplingParams(max_new_tokens=engine.context_len - stream_prompt - 1, ignore_eos=True)
    rids = [engine.add_request([rng.randrange(vocab) for _ in range(stream_prompt)], endless, spec=None)
            for _ in range(streams)]
    last: dict[str, float] = {}
    prompt_steps: list[tuple[int, float]] = []  # (prompt tokens, ms) of each step with the long prompt's chunk
    timeline: list[tuple[int, int, int, float]] = []  # every step in the window: (prompt tokens, decoding, steps, ms)

    def step_and_record(gaps: list[float]) -> list:
        started = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        info = engine.last_step
        if gaps is during and info is not None:
            ms = round(1e3 * (now - started), 2)
            timeline.append((info.prefill_tokens, info.num_decode, info.steps, ms))
            if info.prefill_tokens:
                prompt_steps.append((info.prefill_tokens, ms))
        for o in outputs:
            if o.rid in last and o.new_token_ids:  # a burst of k tokens: one gap, then k - 1 zero gaps
                gaps += [now - last[o.rid]] + [0.0] * (len(o.new_token_ids) - 1)
            if o.new_token_ids:
                last[o.rid] = now
        return outputs

    during: list[float] = []
    while len(last) < streams:  # every stream past its first token
        step_and_record([])
    for _ in range(8):  # warm: runs of steps at full length
        step_and_record([])
    baseline: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < baseline_s:
        step_and_record(baseline)
    arrived = time.perf_counter()
    long_rid = engine.add_request([rng.randrange(vocab) for _ in range(long_tokens)],
                                  SamplingParams(max_new_tokens=1, ignore_eos=True), spec=None)
    outputs: list = []
    while not any(o.rid == long_rid and o.new_token_ids for o in outputs):
        outputs = step_and_record(during)
    ttft = time.perf_counter() - arrived
    # A stream's gap across the prompt's last step closes at its next token: the window runs until each has one.
    closed = {o.rid for o in outputs if o.new_token_ids}
    while any(rid not in closed and rid in engine.requests and not engine.requests[rid].finished for rid in rids):
        closed.update(o.rid for o in step_and_record(during) if o.new_token_ids)
    engine.requests.pop(long_rid, None)
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    base, dur = _gaps_summary(baseline), _gaps_summary(during)
    return {"streams": streams, "baseline": base, "during": dur, "long_ttft_s": ttft, "prompt_steps": prompt_steps,
            "timeline_head": timeline[:80], "timeline_tail": timeline[-40:],
            "p99_ratio": dur["p99_s"] / base["p99_s"] if base["p99_s"] > 0 else float("inf")}
