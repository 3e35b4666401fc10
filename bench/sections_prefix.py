"""Benchmark section ``prefix``: the prefix cache on the 8B shape (random bf16 weights, target only, in
process, graphs on).

- TTFT of a request whose prompt shares a 4k-token prefix with the one before it, against that first
  request's (which prefilled everything): the goal is <= 15 %. Three prefixes, after a warm-up prompt.
- Multi-turn, prefix-heavy traffic: 16 conversations on one 1k-token system prompt, 8 turns each (a turn's
  prompt is the previous prompt, its answer and a new 64-token message; 64-token answers, greedy), every
  conversation's turn sent at once; completion tokens per second over the whole run and the prompt tokens
  prefilled, with the cache and with ``--disable-prefix-caching`` (engines built the same way otherwise).

The helpers below the section take any LLMEngine (tests/test_bench_prefix.py runs them on a tiny CPU model).
"""

from __future__ import annotations

import random
import statistics
import time

from models import LLAMA_8B_SHAPE, target_dir
from measure import free_gpu

PREFIX_TOKENS, SUFFIX_TOKENS, TTFT_REPEATS = 4096, 32, 3
SYSTEM_TOKENS, CONVERSATIONS, TURNS, MESSAGE_TOKENS, ANSWER_TOKENS = 1024, 16, 8, 64, 64
TTFT_GOAL = 0.15


def prefix(ctx: dict) -> dict:
    layers = ctx.get("layers") or LLAMA_8B_SHAPE["num_layers"]
    turns = 3 if ctx["quick"] else TURNS
    out: dict = {"shape": {**LLAMA_8B_SHAPE, "num_layers": layers}}
    engine = _engine(layers, cache=True)
    out["ttft"] = ttft_second_vs_first(engine, PREFIX_TOKENS, SUFFIX_TOKENS, TTFT_REPEATS)
    t = out["ttft"]
    print(f"TTFT, {PREFIX_TOKENS}-token shared prefix: first {1e3 * t['first_s']:.1f} ms, second "
          f"{1e3 * t['second_s']:.1f} ms = {t['ratio']:.1%} of the first (goal <= {TTFT_GOAL:.0%}: "
          f"{'met' if t['goal_met'] else 'NOT met'})", flush=True)
    runs = {}
    for cache in (True, False):
        if not cache:
            engine = _engine(layers, cache=False)
        runs[cache] = multi_turn(engine, SYSTEM_TOKENS, CONVERSATIONS, turns, MESSAGE_TOKENS, ANSWER_TOKENS)
        r = runs[cache]
        print(f"multi-turn, cache {'on ' if cache else 'off'}: {r['tok_s']:8.1f} completion tok/s, "
              f"{r['seconds']:.2f} s, {r['prefilled_tokens']} of {r['prompt_tokens']} prompt tokens prefilled", flush=True)
        engine.shutdown()
        del engine
        free_gpu()
    out["multi_turn"] = {"cache_on": runs[True], "cache_off": runs[False],
                         "x_cache_off": runs[True]["tok_s"] / runs[False]["tok_s"],
                         "same_text_as_cache_off": same_fraction(runs[True].pop("outputs"), runs[False].pop("outputs"))}
    m = out["multi_turn"]
    print(f"multi-turn with the cache / without: {m['x_cache_off']:.2f}x (same greedy tokens in "
          f"{m['same_text_as_cache_off']:.0%} of answers; bf16 prefills with and without a cached prefix round "
          f"differently, so near-ties may part)", flush=True)
    return out


def _engine(layers: int, cache: bool):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    cfg = EngineConfig(model=str(target_dir(layers)), device="cuda", dtype="bfloat16", load_format="random",
                       cuda_graph_max_bs=CONVERSATIONS, kv_pages=6144, enable_prefix_caching=cache)  # 96k tokens
    return LLMEngine(cfg)


# -- helpers (any engine) -------------------------------------------------------------------------
def random_tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def next_turn(prompt: list[int], answer: list[int], message: list[int]) -> list[int]:
    """A conversation's next prompt: everything so far, then the new message."""
    return prompt + answer + message


def same_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def _sync(engine) -> None:
    import torch

    if engine.executor.runner.device.type == "cuda":
        torch.cuda.synchronize()


def time_to_first_token(engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from adding a one-token request to its token (stepping the engine alone) → (seconds,
    cached prompt tokens)."""
    from tandem.sampling import SamplingParams

    _sync(engine)
    started = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True), spec=None)
    while not engine.requests[rid].finished:
        engine.step()
    _sync(engine)
    seconds = time.perf_counter() - started
    return seconds, engine.requests.pop(rid).cached_tokens


def ttft_second_vs_first(engine, prefix_tokens: int, suffix_tokens: int, repeats: int, seed: int = 0) -> dict:
    """Per repeat, a fresh random prefix: the first request (prefix + suffix, nothing cached), then a second
    (prefix + another suffix, the prefix's full pages cached); medians and the second's share."""
    rng, vocab = random.Random(seed), engine.model_config.vocab_size
    time_to_first_token(engine, random_tokens(rng, vocab, prefix_tokens + suffix_tokens))  # warm-up (kernels)
    firsts, seconds, cached = [], [], []
    for _ in range(repeats):
        shared = random_tokens(rng, vocab, prefix_tokens)
        first, hit = time_to_first_token(engine, shared + random_tokens(rng, vocab, suffix_tokens))
        assert hit == 0, "the first request of a fresh prefix found it cached"
        second, hit = time_to_first_token(engine, shared + random_tokens(rng, vocab, suffix_tokens))
        firsts.append(first)
        seconds.append(second)
        cached.append(hit)
    first_s, second_s = statistics.median(firsts), statistics.median(seconds)
    return {"prefix_tokens": prefix_tokens, "first_s": first_s, "second_s": second_s, "ratio": second_s / first_s,
            "goal_met": second_s / first_s <= TTFT_GOAL, "cached_tokens": cached, "firsts_s": firsts,
            "seconds_s": seconds}


def multi_turn(engine, system_tokens: int, conversations: int, turns: int, message_tokens: int,
               answer_tokens: int, seed: int = 1) -> dict:
    """``conversations`` chats on one system prompt, each turn of all of them sent at once (greedy answers of
    ``answer_tokens``) → throughput, tokens, what the cache saved, and every answer."""
    from tandem.sampling import SamplingParams

    rng, vocab = random.Random(seed), engine.model_config.vocab_size
    system = random_tokens(rng, vocab, system_tokens)
    prompts = [system + random_tokens(rng, vocab, message_tokens) for _ in range(conversations)]
    params = SamplingParams(max_new_tokens=answer_tokens, ignore_eos=True)
    outputs, prompt_tokens, cached, completion = [], 0, 0, 0
    _sync(engine)
    started = time.perf_counter()
    for turn in range(turns):
        rids = [engine.add_request(p, params, spec=None) for p in prompts]
        while any(not engine.requests[r].finished for r in rids):
            engine.step()
        answers = []
        for rid in rids:
            req = engine.requests.pop(rid)
            answers.append(req.output)
            prompt_tokens += len(req.prompt)
            cached += req.cached_tokens
            completion += len(req.output)
        outputs += answers
        prompts = [next_turn(p, a, random_tokens(rng, vocab, message_tokens)) for p, a in zip(prompts, answers)]
    _sync(engine)
    seconds = time.perf_counter() - started
    return {"conversations": conversations, "turns": turns, "seconds": seconds, "tok_s": completion / seconds,
            "completion_tokens": completion, "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "prefilled_tokens": prompt_tokens - cached, "outputs": outputs}
