"""cProfile of the arrivals closed loop (bench/sections_arrivals.py) on the shipped demo pair's target, target-only
at concurrency 64 (--concurrency N): host time per function, and the steps and seconds spent with the drafter
attached and detached. Extra arguments go to the verifier's parser (e.g. --prefill-graph-tokens 0, or --drafter
in-process --draft-model DIR; --never-speculating: that drafter's policy never speculates).
  usage: python3 bench/profile_arrivals.py [--concurrency N] [--never-speculating] [--torch-threads N] [--no-profile]
                                           [verifier flags...]"""

from __future__ import annotations

import argparse
import cProfile
import collections
import json
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    import torch

    from sections_arrivals import _closed_loop
    from tandem.training.demo import SHIPPED
    from tandem.training.demo_pair import demo_eval_prompts
    from verifier.__main__ import build_parser
    from verifier.config import VerifierConfig
    from verifier.metrics import VerifierMetrics
    from verifier.engine_build import build_engine

    folder = Path(SHIPPED)
    saved = folder / "prompts.json"
    prompts = json.loads(saved.read_text()) if saved.is_file() else demo_eval_prompts(str(folder / "target"), 64)
    device, dtype = ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--concurrency", type=int, default=64)
    own.add_argument("--never-speculating", action="store_true")
    own.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads before the engine (0: as is)")
    own.add_argument("--no-profile", action="store_true", help="only the timings and the threads' CPU time")
    mine, rest = own.parse_known_args()
    if mine.torch_threads:
        torch.set_num_threads(mine.torch_threads)
    args = build_parser().parse_args(["--model", str(folder / "target"), "--device", device, "--dtype", dtype,
                                      "--kv-pages", "12288", *rest])
    engine, _, _ = build_engine(VerifierConfig.from_args(args, args.model), VerifierMetrics())
    if mine.never_speculating:
        engine.policy.decide = lambda *a, **k: False
    attachment = collections.defaultdict(lambda: [0, 0.0])  # detached? -> steps, seconds
    step = engine.step

    def timed_step():
        detached, t0 = engine.attachment.detached, time.perf_counter()
        try:
            return step()
        finally:
            attachment[detached][0] += 1
            attachment[detached][1] += time.perf_counter() - t0

    engine.step = timed_step
    _closed_loop(engine, prompts, mine.concurrency, 2.0)  # warm
    attachment.clear()
    profile = cProfile.Profile()
    threads_before, wall0 = thread_cpu_ticks(), time.perf_counter()
    if not mine.no_profile:
        profile.enable()
    result = _closed_loop(engine, prompts, mine.concurrency, 4.0)
    profile.disable()
    threads_after, wall = thread_cpu_ticks(), time.perf_counter() - wall0
    print("tok/s", round(result["tok_s"]), round(result["tok_s_settled"]), json.dumps(result["steps"]))
    for detached, (n, s) in sorted(attachment.items()):
        print(f"drafter {'detached' if detached else 'attached'}: {n} steps, {s:.2f} s, {1e3 * s / max(n, 1):.3f} ms a step")
    # A main thread whose CPU ticks fall short of the wall time waited (GIL, a synchronize, preemption); one that
    # used all of it but ran each call slower ran on a slower or shared core.
    print(f"torch threads {torch.get_num_threads()}; {len(os.sched_getaffinity(0))} CPUs allowed; loop wall "
          f"{wall:.2f} s = {wall * os.sysconf('SC_CLK_TCK'):.0f} ticks; the process's threads that ran in the loop "
          f"(CPU ticks of 1/{os.sysconf('SC_CLK_TCK')} s, last CPU):")
    for tid, (name, ticks, cpu) in sorted(threads_after.items(), key=lambda kv: -kv[1][1]):
        used = ticks - threads_before.get(tid, (name, 0, cpu))[1]
        if used:
            print(f"  thread {tid} {name}: {used} (cpu {cpu})")
    if not mine.no_profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(35)
        pstats.Stats(profile).sort_stats("cumtime").print_stats(45)


def thread_cpu_ticks() -> dict[str, tuple[str, int, str]]:
    """This process's threads (Linux): id -> (name, user + system CPU ticks so far, the CPU it last ran on)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            out[tid] = (Path(f"/proc/self/task/{tid}/comm").read_text().strip(), int(fields[11]) + int(fields[12]),
                        fields[36])
        except OSError:  # (a thread that ended meanwhile)
            continue
    return out


if __name__ == "__main__":
    main()
