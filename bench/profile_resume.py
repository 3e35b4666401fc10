#!/usr/bin/env python3
"""What a step that resumes speculation costs at batch: the drafter's catch-up over the plain steps' held input,
then a round — against a plain step and a round queued with others, on the 8B-shaped target and its random head.

A batch of ``--batch`` requests decodes ``--plain`` plain steps with the drafter attached (their features held),
then speculates again; repeated ``--repeats`` times on fresh requests. For each resume step it prints the wall time
and its phases with the device synchronised at each (``draft`` holds the catch-up, split out as ``catch_up``), beside
the plain steps' and the following rounds'; the last resume step is also recorded under torch.profiler (CPU and CUDA)
and its top host ops and kernels printed, the trace written to ``--out-dir``.

    python3 bench/profile_resume.py [--batch 64] [--plain 12] [--layers 32] [--repeats 3] [--out-dir $OUT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from models import LLAMA_8B_SHAPE, bench_drafter, bench_engine  # noqa: E402
from tandem.speculative.policy import PolicyConfig, SpeculationPolicy  # noqa: E402


class Scripted(SpeculationPolicy):
    """Speculates exactly when ``speculate`` says (the script's switch), whatever anything measured."""

    def __init__(self):
        super().__init__(PolicyConfig(enabled=False))
        self.speculate = True

    def decide(self, batch_size, drafting, runs=None):
        return self.speculate and bool(drafting)


def _timed_step(engine) -> tuple[float, dict]:
    torch.cuda.synchronize()
    started = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    info = engine.last_step
    return time.perf_counter() - started, {"steps": info.steps, "speculative": info.speculative,
                                           **{k: round(1e3 * v, 3) for k, v in info.seconds.items()}}


def _until_speculative(engine, limit: int = 4) -> tuple[float, dict, list]:
    """Steps until one speculates: plain runs already queued on the device when the switch came finish first
    (their steps are returned apart, in ms per token), then the resume step itself."""
    queued = []
    for _ in range(limit):
        seconds, info = _timed_step(engine)
        if info["speculative"]:
            return seconds, info, queued
        queued.append(round(1e3 * seconds / info["steps"], 3))
    raise RuntimeError(f"no speculative step within {limit} steps of the switch")


def _one_resume(engine, policy, prompts, params, plain: int, profile_dir: Path | None) -> dict:
    rids = [engine.add_request(p, params) for p in prompts]
    policy.speculate = False
    engine.step()  # the prefills
    plain_ms = []
    for _ in range(plain):
        seconds, info = _timed_step(engine)
        plain_ms.append(1e3 * seconds / info["steps"])
    policy.speculate = True
    catch_up = {}
    flush = engine.drafts.flush_pending

    def timed_flush(reqs):
        catch_up["requests"] = len(reqs)
        catch_up["tokens"] = sum(len(tokens) for req in reqs for tokens, _ in req.pending_extend)
        torch.cuda.synchronize()
        started = time.perf_counter()
        flush(reqs)
        torch.cuda.synchronize()
        catch_up["ms"] = round(1e3 * (time.perf_counter() - started), 3)

    engine.drafts.flush_pending = timed_flush
    engine.phase_sync = torch.cuda.synchronize
    try:
        if profile_dir is None:
            seconds, resume, queued = _until_speculative(engine)
        else:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                seconds, resume, queued = _until_speculative(engine)
            prof.export_chrome_trace(str(profile_dir / "trace-resume.json"))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15), flush=True)
    finally:
        engine.drafts.flush_pending = flush
        engine.phase_sync = None
    rounds = []
    for _ in range(6):
        if not engine.has_unfinished():
            break
        s, info = _timed_step(engine)
        rounds.append((round(1e3 * s / info["steps"], 3), info["steps"]))
    while engine.has_unfinished():
        engine.step()
    for rid in rids:
        engine.requests.pop(rid, None)
    return {"queued_plain_ms": queued, "resume_ms": round(1e3 * seconds, 3), "phases_ms": resume,
            "catch_up": catch_up,
            "plain_ms_median": round(statistics.median(plain_ms), 3), "rounds_after_ms": rounds}


def main(argv=None) -> int:
    from tandem.sampling import SamplingParams
    from tandem.speculative.spec_config import SpecConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--plain", type=int, default=12, help="plain steps (runs of --decode-steps) before the resume")
    ap.add_argument("--layers", type=int, default=LLAMA_8B_SHAPE["num_layers"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", default=".")
    a = ap.parse_args(argv)
    spec = SpecConfig(3, 1, 4)
    engine = bench_engine(a.layers, widths=(1, spec.num_draft_tokens), max_bs=a.batch)
    drafter, _ = bench_drafter(engine, a.layers, [spec], max_bs=a.batch)
    policy = Scripted()
    engine.proposer, engine.default_spec, engine.policy = drafter, spec, policy
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_new_tokens=a.plain * 4 + 64, ignore_eos=True)
    for repeat in range(a.repeats + 1):  # the first: compiles and first launches, not reported
        prompts = [torch.randint(0, vocab, (128,), generator=g).tolist() for _ in range(a.batch)]
        last = repeat == a.repeats
        row = _one_resume(engine, policy, prompts, params, a.plain, Path(a.out_dir) if last else None)
        if repeat:
            print(f"batch {a.batch}, {a.plain} plain steps held{' (profiled)' if last else ''}: {row}", flush=True)
    engine.proposer = None
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
