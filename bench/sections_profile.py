"""Where a step's time goes (``phases``), and the trained demo pair on the GPU (``demo``).

phases: batch-1 plain decode and a speculative round (chain of 3 at controlled accept length 4) on
        the 8B shape, with the device synchronised at every phase end (so each phase's time includes
        its kernels; the total is slightly above the unsynchronised step), then a torch.profiler
        window of each whose top kernels and host ops are printed and whose trace is written next to
        the JSON.
demo:   the demo pair (the project's own trained target and EAGLE-3 head, a folder given by
        TANDEM_DEMO_DIR with target/ and draft/) end to end at batch 1, greedy, on held-out prompts:
        tokens/s with and without speculation, graphs on and off, and the accept length.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from models import LLAMA_8B_SHAPE, bench_drafter, bench_engine


def _trace_dir() -> Path:
    return Path(os.environ.get("OUT", "."))


def _run_phases(engine, rid: str) -> dict[str, float]:
    """Step ``rid`` to the end with synchronised phase timing; → mean ms per phase over decode steps."""
    per_phase: dict[str, list[float]] = {}
    totals = []
    while not engine.requests[rid].finished:
        started = time.perf_counter()
        engine.step()
        info = engine.last_step
        if info.num_prefill:
            continue
        totals.append(time.perf_counter() - started)
        for phase, seconds in info.seconds.items():
            per_phase.setdefault(phase, []).append(seconds)
    out = {phase: 1e3 * statistics.mean(v) for phase, v in per_phase.items()}
    out["step_total"] = 1e3 * statistics.mean(totals)
    nested = ("step_total", "queue")  # queue: the part of a run of chain rounds' verify span spent queuing
    out["host_outside_phases"] = out["step_total"] - sum(v for k, v in out.items() if k not in nested)
    return out


def _profile(engine, prompt, params, steps: int, name: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    rid = engine.add_request(prompt, params)
    for _ in range(4):  # past the prefill
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if engine.requests[rid].finished:
                break
            engine.step()
        torch.cuda.synchronize()
    while not engine.requests[rid].finished:
        engine.step()
    engine.requests.pop(rid)
    path = _trace_dir() / f"trace-{name}.json"
    prof.export_chrome_trace(str(path))
    events = prof.key_averages()
    cuda_top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:18]
    cpu_top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:18]
    print(f"--- {name}: top kernels by device time over {steps} steps (ms per step) ---")
    for e in cuda_top:
        print(f"  {e.self_device_time_total / 1e3 / steps:8.3f}  x{e.count / steps:6.1f}  {e.key[:90]}")
    print(f"--- {name}: top host ops by self CPU time (ms per step) ---")
    for e in cpu_top:
        print(f"  {e.self_cpu_time_total / 1e3 / steps:8.3f}  x{e.count / steps:6.1f}  {e.key[:90]}")
    device_ms = sum(e.self_device_time_total for e in events) / 1e3 / steps
    idle = _idle_gaps(path)
    print(f"--- {name}: GPU busy {idle['busy_ms']:.2f} of {idle['wall_ms']:.2f} ms ({steps} steps); longest idle gaps "
          f"(us, the host call running when it began -> the kernel after it) ---")
    for gap in idle["gaps"]:
        print(f"  {gap[0]:8.1f}  {gap[1][:60]} -> {gap[2][:60]}")
    return {"trace": path.name, "device_ms_per_step": device_ms, "idle": idle,
            "top_kernels": [(e.key, e.self_device_time_total / 1e3 / steps, e.count / steps) for e in cuda_top],
            "top_host_ops": [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in cpu_top]}


def _idle_gaps(trace_path, top: int = 12) -> dict:
    """From a profiler trace: the GPU's busy time (kernels, copies, memsets merged), the window's wall
    time, and its longest idle gaps, each with the host call that was running when the gap began (what
    the GPU waited for) and the first GPU op after it."""
    events = [e for e in json.load(open(trace_path))["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    host = sorted((e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "python_function")),
                  key=lambda e: e["ts"])
    if not gpu:
        return {"busy_ms": 0.0, "wall_ms": 0.0, "gaps": []}
    busy, gaps, end = 0.0, [], gpu[0]["ts"]
    for e in gpu:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, e["name"]))
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    out = []
    for length, start, after in sorted(gaps, reverse=True)[:top]:
        running = [h for h in host if h["ts"] <= start < h["ts"] + h["dur"]]
        innermost = min(running, key=lambda h: h["dur"])["name"] if running else "(no host call)"
        out.append((round(length, 1), innermost, after))
    return {"busy_ms": busy / 1e3, "wall_ms": (end - gpu[0]["ts"]) / 1e3, "gaps": out}


def phases(ctx: dict) -> dict:
    from measure import rate_for
    from tandem.sampling import SamplingParams
    from tandem.speculative.controlled import ControlledAcceptanceProposer
    from tandem.speculative.spec_config import SpecConfig

    layers = ctx.get("layers") or LLAMA_8B_SHAPE["num_layers"]
    sc = SpecConfig(3, 1, 4)
    engine = bench_engine(layers, widths=(1, sc.num_draft_tokens), max_bs=8)
    drafter, _ = bench_drafter(engine, layers, [sc])
    prompt = torch.randint(0, engine.model_config.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = SamplingParams(max_new_tokens=96, ignore_eos=True)
    engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True), spec=None)  # warm-up
    result: dict = {}

    # Plain decode.
    started = time.perf_counter()
    engine.generate([prompt], greedy, spec=None)
    result["decode_tok_s"] = 96 / (time.perf_counter() - started)
    engine.phase_sync = torch.cuda.synchronize
    result["decode_phases_ms"] = _run_phases(engine, engine.add_request(prompt, greedy, spec=None))
    engine.phase_sync = None
    result["decode_profile"] = _profile(engine, prompt, SamplingParams(max_new_tokens=64, ignore_eos=True, ), 24, "decode")
    print(f"decode bs1: {result['decode_tok_s']:.1f} tok/s; phases (ms, synced): {_fmt(result['decode_phases_ms'])}", flush=True)

    # A speculative round at accept length 4, steered as in the spec section.
    steer = ControlledAcceptanceProposer(drafter, 1.0, seed=1)
    engine.proposer, engine.default_spec = steer, sc
    rid = engine.add_request(prompt, greedy)
    steer.set_reference(rid, len(prompt), [0] * 200)
    while not engine.requests[rid].finished:
        engine.step()
    reference = engine.requests.pop(rid).output

    def steered(sync):
        proposer = ControlledAcceptanceProposer(drafter, rate_for(4.0, sc.num_steps), seed=1)
        engine.proposer = proposer
        engine.phase_sync = sync
        rid = engine.add_request(prompt, greedy)
        proposer.set_reference(rid, len(prompt), reference + [0] * 16)
        return rid

    rid = steered(None)
    started, queued, rounds = time.perf_counter(), 0.0, 0
    while not engine.requests[rid].finished:
        engine.step()
        if "queue" in engine.last_step.spans:  # a run of chain rounds queued on the device
            queued += engine.last_step.seconds["queue"]
            rounds += 1
    req = engine.requests.pop(rid)
    result["spec_tok_s"] = 96 / (time.perf_counter() - started)
    result["spec_queue_ms_per_run"] = 1e3 * queued / max(rounds, 1)
    print(f"spec: {rounds} runs of queued rounds, host queuing {result['spec_queue_ms_per_run']:.2f} ms per run "
          f"({req.spec_stats.rounds} rounds in all)", flush=True)
    result["spec_accept_length"] = req.spec_stats.accept_length_mean
    result["spec_phases_ms"] = _run_phases(engine, steered(torch.cuda.synchronize))
    engine.phase_sync = None
    print(f"spec chain3 accept {result['spec_accept_length']:.2f}: {result['spec_tok_s']:.1f} tok/s "
          f"({result['spec_tok_s'] / result['decode_tok_s']:.2f}x); phases (ms, synced): {_fmt(result['spec_phases_ms'])}",
          flush=True)
    proposer = ControlledAcceptanceProposer(drafter, rate_for(4.0, sc.num_steps), seed=1)
    engine.proposer = proposer
    result["spec_profile"] = _profile_spec(engine, proposer, prompt, reference)
    engine.proposer = None
    engine.shutdown()
    return result


def _profile_spec(engine, proposer, prompt, reference) -> dict:
    from tandem.sampling import SamplingParams

    original_add = engine.add_request

    def add_with_reference(p, params, **kw):  # the profiler helper adds the request itself
        rid = original_add(p, params, **kw)
        proposer.set_reference(rid, len(p), reference + [0] * 16)
        return rid

    engine.add_request = add_with_reference
    try:
        return _profile(engine, prompt, SamplingParams(max_new_tokens=96, ignore_eos=True), 12, "spec")
    finally:
        engine.add_request = original_add


def _fmt(phases_ms: dict) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in phases_ms.items())


def demo(ctx: dict) -> dict:
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.sampling import SamplingParams
    from tandem.speculative.spec_config import SpecConfig
    from tandem.speculative.policy import PolicyConfig, SpeculationPolicy
    from tandem.engine.speculative_setup import speculative_engine
    from tandem.training.demo_pair import demo_eval_prompts

    folder = Path(os.environ.get("TANDEM_DEMO_DIR", "demo-pair"))
    target, draft = str(folder / "target"), str(folder / "draft")
    saved = folder / "prompts.json"  # the held-out prompts as made where the pair was trained (its stdlib)
    prompts = json.loads(saved.read_text()) if saved.is_file() else demo_eval_prompts(target, 16)
    device = os.environ.get("TANDEM_BENCH_DEVICE", "cuda")
    params = SamplingParams(temperature=0.0, max_new_tokens=96)
    rows = []
    for graphs in (True, False):
        # The measured policy (the serving default) turns speculation off where a round costs more than
        # its accept length pays for; "always" speculates every round (what acceptance alone gives);
        # "off" is a speculative engine whose policy never speculates after the warm-up: what holding the
        # drafter's features through plain steps costs next to target-only.
        kinds = ((None, None), (3, "always"), (5, "always"), (5, "measured")) + (((5, "off"),) if graphs else ())
        # Every engine of a setting stays loaded and the rows are timed in turn, several passes, best
        # kept: a step of these tiny models is mostly host work, and rows timed one after the other move
        # with the host's speed.
        passes = 3 if graphs else 1
        with contextlib.ExitStack() as stack:
            engines = []
            for steps, policy in kinds:
                cfg = EngineConfig(model=target, device=device, kv_pages=4097, disable_cuda_graph=not graphs,
                                   cuda_graph_max_bs=8)
                chosen = SpeculationPolicy(PolicyConfig(enabled=policy != "always",
                                                        fixed_cost_ratio=1e6 if policy == "off" else None))
                engine = stack.enter_context(LLMEngine(cfg) if steps is None else
                                             speculative_engine(cfg, draft, SpecConfig(steps, 1, steps + 1), policy=chosen))
                spec = None if steps is None else engine.default_spec
                engine.generate([prompts[0]], params, spec=spec)  # warm-up
                engines.append((engine, spec, chosen))
            best = [None] * len(kinds)
            for _ in range(passes):
                for i, (engine, spec, _) in enumerate(engines):
                    run = _demo_run(engine, prompts, params, spec)
                    if best[i] is None or run["tok_s"] > best[i]["tok_s"]:
                        best[i] = run
            for (steps, policy), (_, _, chosen), run in zip(kinds, engines, best):
                row = {"graphs": graphs, "chain_steps": steps, "policy": policy, "passes": passes, **run}
                if policy == "measured":  # what the policy measured (at the end): why it chose as it did
                    row.update(cost_ratio=chosen.cost_ratio(1), t_plain_ms=1e3 * (chosen.step_time(1, False) or 0),
                               t_spec_ms=1e3 * (chosen.step_time(1, True) or 0), engine_tau=chosen.tau_all or 0.0)
                rows.append(row)
                what = "target only" if steps is None else f"chain {steps} {policy}"
                print(f"demo pair graphs {'on ' if graphs else 'off'} {what:18s}: "
                      f"{row['tok_s']:7.1f} tok/s" + (f", accept {row['accept_length']:.2f}" if row["rounds"] else "")
                      + (f" (measured: round = {row['cost_ratio']:.2f} plain steps of {row['t_plain_ms']:.3f} ms, "
                         f"engine τ {row['engine_tau']:.2f})" if "cost_ratio" in row else ""), flush=True)
    return {"prompts": len(prompts), "max_new_tokens": 96, "rows": rows}


def _demo_run(engine, prompts: list[list[int]], params, spec) -> dict:
    """The prompts one at a time (batch 1) → tokens/s, rounds and accept length."""
    tokens, rounds, accepted, started = 0, 0, 0, time.perf_counter()
    for p in prompts:
        res = engine.generate([p], params, spec=spec)[0]
        tokens += len(res.output_token_ids)
        rounds += res.spec_stats.rounds
        accepted += sum(res.spec_stats.accepted_per_round)
    elapsed = time.perf_counter() - started
    return {"tokens": tokens, "tok_s": tokens / elapsed, "rounds": rounds,
            "accept_length": 1 + accepted / rounds if rounds else None}
