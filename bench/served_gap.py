#!/usr/bin/env python3
"""Where a served engine's tokens get slower than ``generate()``'s, one layer at a time (no network): the demo target
at batch 1 (its held-out prompts, 120 new tokens each, greedy, ignore_eos), closed loop, on

  bench:   an engine as ``bench --sections demo`` builds it, ``generate()`` a prompt at a time;
  served:  the engine the verifier builds from its command line (verifier/engine_build.py: warm-up, frozen heap,
           the compile watch), ``generate()`` a prompt at a time;
  loop:    that engine under the verifier's EngineLoop on its thread (metrics, stats line, sinks), a submission
           at a time from this thread;
  process: the verifier's EngineProcess (the loop in a child process, outputs over its pipe), the same way.

Prints each layer's median request time (tokens/s at it) over ``--passes`` of the prompts, request by request
through every layer in turn; ``--profile DIR`` also writes cProfile's table of the
engine's thread for ``served`` and ``loop`` (calls a token: what the loop adds).

    python bench/served_gap.py [--prompts 16] [--tokens 120] [--passes 3] [--profile DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import queue
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]


def _served_config(target: str, device: str, extra: list[str]):
    from verifier.__main__ import build_parser
    from verifier.config import VerifierConfig
    from tandem import command_line

    args = command_line.parse_args(build_parser(), ["--model", target, "--kv-pages", "12288", "--device", device,
                                                    "--dtype", "bfloat16" if device == "cuda" else "float32", *extra])
    return VerifierConfig.from_args(args, target)


class _Waiter:
    """A plain sink: one request's outputs until its finish, with when the first came."""

    def __init__(self):
        self.done: queue.Queue = queue.Queue()
        self.first = None

    def __call__(self, out) -> None:
        if isinstance(out, BaseException):
            self.done.put(out)
            return
        if self.first is None:
            self.first = time.perf_counter()
        if out.finish_reason is not None:
            self.done.put(None)


def _submitted(submit, prompt, params) -> tuple[float, float]:
    """One request through ``submit`` (an EngineLoop's or EngineProcess's) → (seconds to its last output, to its
    first)."""
    from verifier.engine_api import Submission

    waiter, started = _Waiter(), time.perf_counter()
    sub = Submission(rid=f"r{time.monotonic_ns()}", prompt=prompt, params=params, spec=None, sink=waiter)
    submit(sub).result(timeout=60)
    error = waiter.done.get(timeout=60)
    if error is not None:
        raise error
    return time.perf_counter() - started, waiter.first - started


def _generated(engine, prompt, params) -> tuple[float, float]:
    """→ (seconds, this thread's CPU seconds in them)."""
    started, cpu = time.perf_counter(), time.thread_time()
    engine.generate([prompt], params, spec=None)
    return time.perf_counter() - started, time.thread_time() - cpu


def _profiled(fn, path: Path, tokens: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    _write(prof, path, tokens)


def _write(prof: cProfile.Profile, path: Path, tokens: int) -> None:
    """The profile's 45 costliest functions by their own time, after a line with the tokens it covers."""
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(45)
    path.write_text(f"tokens {tokens}\n" + out.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--device", default="cuda", help="(cpu: to try the script)")
    ap.add_argument("--layers", nargs="+", default=["bench", "served", "loop", "process"])
    ap.add_argument("--orders", nargs="+", default=["interleaved"], choices=("interleaved", "grouped"))
    a = ap.parse_args()
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.sampling import SamplingParams
    from tandem.training.demo import SHIPPED
    from tandem.training.demo_pair import demo_eval_prompts
    from verifier.engine_build import build_engine
    from verifier.engine_loop import EngineLoop
    from verifier.engine_process import EngineProcess
    from verifier.metrics import VerifierMetrics

    target = str(Path(SHIPPED) / "target")
    prompts = demo_eval_prompts(target, a.prompts)
    params = SamplingParams(temperature=0.0, max_new_tokens=a.tokens, ignore_eos=True)
    bench_engine = LLMEngine(EngineConfig(model=target, device=a.device, kv_pages=4097, cuda_graph_max_bs=8))
    bench_engine.generate([prompts[0]], params, spec=None)
    cfg = _served_config(target, a.device, ["--no-engine-process"])
    served, _, _ = build_engine(cfg, VerifierMetrics())  # generate() on it, on this thread
    metrics = VerifierMetrics()
    looped, _, _ = build_engine(cfg, metrics)
    loop = EngineLoop(lambda: (looped, None, None), metrics, cfg.max_waiting)
    loop.start()
    loop.built.result()
    process = EngineProcess(_served_config(target, a.device, ["--engine-process"]))
    process.start()
    process.built.result(timeout=600)
    layers = {
        "bench": lambda p: _generated(bench_engine, p, params),
        "served": lambda p: _generated(served, p, params),
        "loop": lambda p: _submitted(loop.submit, p, params),
        "process": lambda p: _submitted(process.submit, p, params),
    }
    layers = {name: layers[name] for name in a.layers}
    for order in a.orders:
        print(f"-- {order}", flush=True)
        best = _timed(layers, prompts, a, order)
    if a.profile is not None:
        a.profile.mkdir(parents=True, exist_ok=True)
        _profiled(lambda: [layers["served"](p) for p in prompts], a.profile / "served.txt", a.prompts * a.tokens)
        profile_loop(loop, lambda: [layers["loop"](p) for p in prompts], a.profile / "loop.txt", a.prompts * a.tokens)
    print(json.dumps({k: round(v, 1) for k, v in best.items()}))
    for name in set(layers) - {"bench"}:
        print(f"{name} / bench: {best[name] / best['bench']:.3f}")
    loop.stop()
    loop.join(timeout=30)
    process.stop()
    process.join(timeout=60)


def _timed(layers, prompts, a, order: str) -> dict[str, float]:
    """``interleaved``: request by request through every layer in turn (the host's drift is shared); ``grouped``: a
    layer's requests back to back, layer after layer."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in layers}
    for _ in range(a.passes):
        if order == "interleaved":
            for p in prompts:
                for name, fn in layers.items():
                    times[name].append(fn(p))
        else:
            for name, fn in layers.items():
                times[name].extend(fn(p) for p in prompts)
    best = {}
    for name, runs in times.items():
        total = statistics.median(t for t, _ in runs)
        other = statistics.median(f for _, f in runs)
        best[name] = a.tokens / total
        print(f"{name:8s} median request {1e3 * total:6.2f} ms = {a.tokens / total:7.1f} tok/s; "
              + ("first output" if name in ("loop", "process") else "its thread's CPU") + f" {1e3 * other:5.2f} ms",
              flush=True)
    return best


def profile_loop(loop, fn, path: Path, tokens: int) -> None:
    """cProfile the loop's own thread while ``fn`` drives it (enabled inside that thread, around each of its steps)."""
    prof = cProfile.Profile()
    step = loop._step

    def profiled_step():
        prof.enable()
        try:
            step()
        finally:
            prof.disable()

    loop._step = profiled_step
    try:
        fn()
    finally:
        loop._step = step
    _write(prof, path, tokens)


if __name__ == "__main__":
    main()
