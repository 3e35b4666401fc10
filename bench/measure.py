"""What several benchmark sections measure with: GPU event timing, memory after a teardown, target-only
decode rate, and the corruption rate of the controlled-acceptance instrument for a goal accept length."""

from __future__ import annotations

import statistics
import time

import torch


def events_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def read_seconds(nbytes: float, copy_tbps: float) -> float:
    """Seconds to read ``nbytes`` at the measured copy rate (``ceilings``): that rate counts a copy's read and
    written bytes alike, so it is what the memory sustains, and a pure read goes no faster."""
    return nbytes / (copy_tbps * 1e12)


def free_gpu() -> None:
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    print(f"(GPU memory free after teardown: {free / 2**30:.1f} of {total / 2**30:.1f} GiB)", flush=True)


def decode_tok_s(engine, bs: int, new_tokens: int, prompt_len: int = 128) -> dict:
    from tandem.sampling import SamplingParams

    g = torch.Generator().manual_seed(bs)
    vocab = engine.model_config.vocab_size
    rids = [engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                               SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), spec=None) for _ in range(bs)]
    engine.step()  # prefill (and the first token) is not decode
    torch.cuda.synchronize()
    started, tokens, engine_steps = time.perf_counter(), 0, 0
    while any(not engine.requests[r].finished for r in rids):
        tokens += sum(len(o.new_token_ids) for o in engine.step())  # several per step with --decode-steps
        engine_steps += 1
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    for r in rids:
        engine.requests.pop(r)
    per_request = tokens / bs
    return {"batch": bs, "tokens": tokens, "engine_steps": engine_steps, "tok_s": tokens / elapsed,
            "tok_s_per_request": per_request / elapsed, "ms_per_step": 1e3 * elapsed / per_request}


def interleaved_decode(engines: dict, repeats: int, label: str, new_tokens: int = 256) -> dict[str, list[float]]:
    """Batch-1 decode tok/s of each engine (name -> engine), warmed up, then ``repeats`` passes taking each in turn
    (this host's pass-to-pass drift hits them alike); printed per engine with ``label``."""
    for engine in engines.values():
        decode_tok_s(engine, 1, 16)  # warm-up
    results: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            results[name].append(decode_tok_s(engine, 1, new_tokens)["tok_s"])
    for name, rates in results.items():
        print(f"{label}, {name:15s}: " + " ".join(f"{r:.1f}" for r in rates) + f" tok/s, mean {sum(rates) / len(rates):.1f}")
    return results


def rate_for(accept_length: float, depth: int) -> float:
    """Corruption rate giving the expected accept length of a path of ``depth`` drafts (bisection)."""
    from tandem.speculative.controlled import expected_accept_length

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_accept_length(mid, depth) > accept_length else (lo, mid)
    return (lo + hi) / 2
