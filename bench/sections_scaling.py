"""Benchmark sections beyond one process and one GPU: the service pair, and tensor parallelism."""

from __future__ import annotations

import os
import time

import torch

from models import LLAMA_8B_SHAPE, bench_drafter, bench_engine, random_draft, target_dir, write_target_embedding
from measure import decode_tok_s, free_gpu
from sections_profile import _run_phases
from service_pair import ENGINE_PHASES, round_parts, round_parts_ms, service_pair


def service(ctx: dict) -> dict:
    """The drafter and verifier as separate services against the same engine and head in one process,
    same settings, batch 1: rounds on the round lane (the default), on the lane with the drafter
    busy-polling between rounds (--round-lane-busy-poll-ms), on the gRPC stream, and with the head inside
    the verifier service (--drafter in-process: the service shell's own cost); features through the
    shared-memory ring. Random head: acceptance is what it is (~1), which isolates the per-round cost of
    the service boundary. The in-process engine stays loaded and is timed again right before each pair
    (the host's speed drifts within a call), and each side
    is timed twice, best kept; each ratio compares a pair with its own in-process neighbour. In process
    the default queues greedy chain rounds on the device (--spec-rounds), which the pair cannot: the
    goal's ratio is against that default, and a second one against one round per step isolates the
    boundary.
    TANDEM_BENCH_PROFILE_DRAFTER=1 adds a pair whose drafter traces 64 rounds with the torch profiler
    (``--profile-rounds``: a Chrome trace in $OUT, the busiest host ops and kernels in the log)."""
    from tandem.sampling import SamplingParams
    from tandem.speculative.spec_config import SpecConfig

    layers = ctx.get("layers") or LLAMA_8B_SHAPE["num_layers"]
    new_tokens = 48 if ctx["quick"] else 128
    spec = SpecConfig(3, 1, 4)
    tdir = target_dir(layers)
    write_target_embedding(tdir)
    prompt = torch.randint(0, LLAMA_8B_SHAPE["vocab_size"], (128,), generator=torch.Generator().manual_seed(0)).tolist()

    engine = bench_engine(layers, widths=(1, spec.num_draft_tokens), max_bs=8)
    drafter, _ = bench_drafter(engine, layers, [spec])
    draft_dir = random_draft(tdir, engine.executor.runner.capture_layers)  # the same folder, for the drafter service
    engine.proposer, engine.default_spec = drafter, spec
    engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up

    queued_rounds = engine.spec_rounds  # the in-process default (--spec-rounds); the pair cannot queue rounds

    def in_process(spec_rounds: int) -> tuple[float, dict[str, float]]:
        engine.spec_rounds = spec_rounds
        best = (0.0, {})
        for _ in range(2):
            tok_s, phases = _in_process_run(engine, prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
            best = max(best, (tok_s, phases), key=lambda r: r[0])
        engine.spec_rounds = queued_rounds
        return best

    flags = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    out = {"transports": {}}
    # (name, verifier flags, drafter flags; None: no drafter service, the head inside the verifier)
    runs = [("lane", [], []), ("lane, rounds one at a time", ["--spec-rounds", "1"], []),
            ("lane, drafter busy-polls", [], ["--round-lane-busy-poll-ms", "20"]),
            ("stream", ["--disable-round-lane"], []), ("head in the verifier", [], None)]
    if os.environ.get("TANDEM_BENCH_PROFILE_DRAFTER") == "1":  # its timeline goes to $OUT, its summary to the log
        runs.append(("lane, drafter profiled", ["--drafter-deadline-ms", "60000"],  # a trace's start and end take seconds
                     ["--profile-rounds", "64", "--profile-dir", os.environ.get("OUT", ".")]))
    try:
        for transport, extra, drafter_extra in runs:
            # The pair goes one round per step; in process, the default queues rounds on the device. The goal's
            # ratio is against the default; the one-round ratio isolates the boundary itself.
            inproc, _ = in_process(queued_rounds)
            inproc_one, phases_in = in_process(1)
            print(f"in process:   {inproc:7.1f} tok/s with {queued_rounds} rounds per step, {inproc_one:7.1f} one round "
                  f"per step; ms per step: " + _phase_line(phases_in, phases_in["step_total"]), flush=True)
            with service_pair(tdir, draft_dir, "cuda", "bfloat16", flags,
                              verifier_flags=["--load-format", "random", "--kv-pages", "2048", "--cuda-graph-max-bs", "8",
                                              *extra],
                              drafter_flags=["--cuda-graph-max-bs", "8", *(drafter_extra or [])],
                              head_in_verifier=drafter_extra is None) as (generate, m_port):
                generate(prompt, 32)  # warm-up: the drafter's first rounds (allocator growth, first eager extend)
                best = None
                for _ in range(2):
                    started = time.perf_counter()
                    before = round_parts(m_port)
                    last = generate(prompt, new_tokens)
                    served = new_tokens / (time.perf_counter() - started)
                    if best is None or served > best[0]:
                        best = (served, round_parts_ms(before, round_parts(m_port)), last)
            served, parts, last = best
            per_round_ms = (1e3 * new_tokens / served - 1e3 * new_tokens / inproc_one) / max(1, last.spec.rounds)
            print(f"{transport}: per round: drafter work {parts['drafter']:.3f} ms (extend {parts['extend']:.3f}, draft "
                  f"and waiting for its tokens {parts['draft']:.3f}); the engine waited {parts['wait']:.3f} ms; "
                  f"{parts['chain_runs']:.0f} runs queued on the device with the drafter; "
                  f"{parts['direct_rounds']:.0f} of {parts['rounds']:.0f} rounds sent when drafting (not prefetched): "
                  f"rest of their round trip {parts['boundary']:.3f} ms", flush=True)
            print(f"{transport}: as services {served:7.1f} tok/s ({last.spec.rounds} rounds, accept "
                  f"{last.spec.accept_length_mean:.2f}); service pair at {served / inproc:.1%} of in process "
                  f"({served / inproc_one:.1%} of one round per step); boundary cost "
                  f"{per_round_ms:.3f} ms/round", flush=True)
            print(f"{transport}, ms per step: " + _phase_line({p: parts[f"step_{p}"] for p in ENGINE_PHASES},
                                                               1e3 * new_tokens / served / max(1.0, parts["steps"])),
                  flush=True)
            if "--profile-rounds" in (drafter_extra or []):
                continue  # profiled: its speed is not a figure
            out["transports"][transport] = {"in_process_tok_s": inproc, "in_process_rounds_per_step": queued_rounds,
                                            "in_process_one_round_tok_s": inproc_one,
                                            "in_process_phases_ms": phases_in, "service_tok_s": served,
                                            "ratio": served / inproc, "ratio_one_round": served / inproc_one,
                                            "rounds_service": last.spec.rounds, "boundary_ms_per_round": per_round_ms,
                                            "round_trip_parts_ms": parts}
    finally:
        engine.proposer = None
        engine.shutdown()
    engine = drafter = None  # noqa: F841 - the references go before the GPU memory is freed
    free_gpu()
    out.update(out["transports"]["lane"])  # the default transport's figures at the top level, as before
    return out


def _in_process_run(engine, prompt: list[int], params) -> tuple[float, dict[str, float]]:
    """One request through the in-process engine → (tok/s, mean ms of each engine phase per decode step,
    and the step's total: sections_profile._run_phases, unsynchronised here)."""
    rid = engine.add_request(prompt, params)
    started = time.perf_counter()
    phases = _run_phases(engine, rid)
    tok_s = params.max_new_tokens / (time.perf_counter() - started)
    engine.requests.pop(rid)
    return tok_s, phases


def _phase_line(phases: dict[str, float], step_ms: float) -> str:
    """The engine step's phases (ms) and what the step spends outside them (the loop, streaming)."""
    inside = sum(phases[p] for p in ENGINE_PHASES)
    return ", ".join(f"{p} {phases[p]:.3f}" for p in ENGINE_PHASES) + f"; outside phases {step_ms - inside:.3f}"


def tp(ctx: dict) -> dict:
    """Tensor parallelism on a Llama-3-70B-shaped model with fewer layers: decode tokens/s at TP=1 and
    TP=N (all GPUs of the machine), graphs on, batch 1 and 8."""
    from models import LLAMA_70B_SHAPE, bench_engine_for

    gpus = torch.cuda.device_count()
    layers = 8 if ctx["quick"] else 16
    out = {"shape": {**LLAMA_70B_SHAPE, "num_layers": layers}, "rows": []}
    for size in sorted({1, gpus}):
        engine = bench_engine_for(LLAMA_70B_SHAPE, layers, tp_size=size)
        for bs in (1, 8):
            row = {"tp": size, **decode_tok_s(engine, bs, 32 if ctx["quick"] else 64)}
            out["rows"].append(row)
            print(f"70B shape, {layers} layers, TP={size}, batch {bs}: {row['tok_s']:8.1f} tok/s "
                  f"({row['ms_per_step']:.2f} ms/step)", flush=True)
        engine.shutdown()
        del engine
        free_gpu()
    return out

