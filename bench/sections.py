"""The benchmark's sections. Each takes the shared context dict and returns JSON-able results."""

from __future__ import annotations

import time

import torch

from measure import decode_tok_s, events_ms, free_gpu, rate_for, read_seconds
from models import LLAMA_8B_SHAPE, bench_drafter, bench_engine, weight_bytes_per_token






def ceilings(ctx: dict) -> dict:
    n = 1 << 30  # 2 GiB of bf16 each way
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src), 20)
    copy_tbps = 2 * src.numel() * 2 / (ms / 1e3) / 1e12
    src = dst = None  # frees the 4 GiB (the timed lambda still names them: no del)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = events_ms(lambda: a @ b, 10)
    tflops = 2 * 8192**3 / (ms / 1e3) / 1e12
    ctx["copy_tbps"] = copy_tbps
    print(f"device copy {copy_tbps:.2f} TB/s (read+write); bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
    return {"copy_TBps": copy_tbps, "bf16_matmul_TFLOPs": tflops}


def gemv_chain_tok_s(shape: dict, layers: int) -> float:
    """The model's weight GEMVs alone (fused QKV, o, fused gate/up, down per layer; the LM head), one CUDA
    graph, batch 1: what any engine built on cuBLAS GEMVs can at best reach."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_kv_heads"] * (h // shape["num_heads"])
    mats = [[torch.randn(h + 2 * kv, h, device="cuda", dtype=torch.bfloat16) * 0.02,
             torch.randn(h, h, device="cuda", dtype=torch.bfloat16) * 0.02,
             torch.randn(2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02,
             torch.randn(h, i, device="cuda", dtype=torch.bfloat16) * 0.02] for _ in range(layers)]
    head = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)

    def chain():
        y = x
        for qkv, o, gu, d in mats:
            y = (y @ qkv.t())[:, :h] @ o.t()
            y = (y @ gu.t())[:, :i] @ d.t()
        return y @ head.t()

    chain()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    ms = events_ms(g.replay, 30)
    mats = head = None  # frees the weights (the chain closure still names them: no del)
    torch.cuda.empty_cache()
    return 1e3 / ms




def _batch1_variants(engine, layers: int, new_tokens: int) -> dict:
    """Batch-1 decode as built (Triton GEMVs, programmatic dependent launch, decode steps queued ahead)
    against a second engine captured with cuBLAS GEMVs and plain launches, each with 1, 4 and 8 decode
    steps per engine step (and the first with runs of 4 and 8 read back one at a time, not overlapped):
    every variant runs in turn, three passes, best kept (hosts drift by several percent within one call)."""
    from tandem.kernels.pdl import set_pdl
    from tandem.layers.fast_path import gemv_max_rows, set_gemv_max_rows

    rows_before = gemv_max_rows()
    set_pdl(False)
    set_gemv_max_rows(0)
    try:
        plain = bench_engine(layers, widths=(1,), max_bs=1)
    finally:
        set_pdl(True)
        set_gemv_max_rows(rows_before)
    default_steps = engine.decode_steps
    variants = [(f"{kernels}, decode_steps={k}", eng, k, True)
                for kernels, eng in (("triton_gemv_pdl", engine), ("cublas_no_pdl", plain)) for k in (1, 4, 8)]
    # runs of queued steps read back one at a time (no overlap: the host's read-back and commit between runs)
    variants += [(f"triton_gemv_pdl, decode_steps={k}, no overlap", engine, k, False) for k in (4, 8)]
    best = {name: 0.0 for name, *_ in variants}
    for _ in range(3):
        for name, eng, k, overlap in variants:
            eng.decode_steps, eng.overlap_runs = k, overlap
            best[name] = max(best[name], decode_tok_s(eng, 1, new_tokens)["tok_s"])
    engine.decode_steps, engine.overlap_runs = default_steps, True
    replay = {"triton_gemv_pdl": events_ms(engine.executor.runner.graphs.graphs[(1, 1)].replay, 30),
              "cublas_no_pdl": events_ms(plain.executor.runner.graphs.graphs[(1, 1)].replay, 30)}
    for name in best:
        print(f"batch 1, {name:45s}: {best[name]:7.1f} tok/s", flush=True)
    for name, ms in replay.items():
        print(f"bare replay of the batch-1 decode graph, {name}: {ms:.3f} ms = {1e3 / ms:.0f} tok/s", flush=True)
    plain.shutdown()
    return {"engine_tok_s": best, "replay_ms": replay, "default_decode_steps": default_steps}


def decode(ctx: dict) -> dict:
    layers = ctx.get("layers") or LLAMA_8B_SHAPE["num_layers"]
    new_tokens = 32 if ctx["quick"] else 128
    out: dict = {"shape": {**LLAMA_8B_SHAPE, "num_layers": layers}}
    bytes_per_token = weight_bytes_per_token(LLAMA_8B_SHAPE, layers)
    copy = ctx.get("copy_tbps") or ceilings(ctx)["copy_TBps"]
    out["weight_GB_per_token"] = bytes_per_token / 1e9
    out["bandwidth_limit_tok_s"] = 1 / read_seconds(bytes_per_token, copy)
    out["gemv_chain_tok_s"] = gemv_chain_tok_s(LLAMA_8B_SHAPE, layers)
    print(f"bandwidth limit {out['bandwidth_limit_tok_s']:.0f} tok/s ({out['weight_GB_per_token']:.2f} GB/token); "
          f"graphed GEMV chain {out['gemv_chain_tok_s']:.0f} tok/s", flush=True)
    engine = bench_engine(layers, widths=(1,), max_bs=64)
    out["capture"] = engine.executor.runner.graph_report
    rows = []
    for bs in ((1, 8) if ctx["quick"] else (1, 8, 32, 64)):
        row = decode_tok_s(engine, bs, new_tokens)
        rows.append(row)
        print(f"graphs on  batch {bs:3d}: {row['tok_s']:8.1f} tok/s ({row['tok_s_per_request']:.1f} per request, "
              f"{row['ms_per_step']:.2f} ms/step)", flush=True)
    out["graph_replay_ms_bs1"] = events_ms(engine.executor.runner.graphs.graphs[(1, 1)].replay, 30)
    print(f"bare graph replay, batch 1: {out['graph_replay_ms_bs1']:.3f} ms = {1e3 / out['graph_replay_ms_bs1']:.0f} tok/s",
          flush=True)
    out["graphs_on"] = rows
    out["batch1_variants"] = _batch1_variants(engine, layers, new_tokens)
    engine.shutdown()
    del engine
    free_gpu()
    eager = bench_engine(layers, widths=(1,), max_bs=1, disable_graphs=True)
    row = decode_tok_s(eager, 1, min(new_tokens, 32))
    print(f"graphs off batch   1: {row['tok_s']:8.1f} tok/s", flush=True)
    out["graphs_off"] = [row]
    eager.shutdown()
    del eager
    free_gpu()
    ctx["target_only_bs1"] = rows[0]["tok_s"]
    return out




def spec(ctx: dict) -> dict:
    from tandem.sampling import SamplingParams
    from tandem.speculative.controlled import ControlledAcceptanceProposer
    from tandem.speculative.spec_config import SpecConfig

    layers = ctx.get("layers") or LLAMA_8B_SHAPE["num_layers"]
    new_tokens = 48 if ctx["quick"] else 160
    goal_only = ctx.get("goal_only", False)  # the spec_goal section: the goal's rows alone
    settings = [("chain", SpecConfig(5, 1, 6))] if ctx["quick"] else [("chain", SpecConfig(3, 1, 4))] if goal_only else [
        ("chain", SpecConfig(5, 1, 6)), ("chain", SpecConfig(3, 1, 4)), ("tree", SpecConfig(5, 4, 16))]
    widths = tuple(sorted({1, *(s.num_draft_tokens for _, s in settings)}))
    rows = []
    for graphs in ((True,) if ctx["quick"] or goal_only else (True, False)):
        engine = bench_engine(layers, widths=widths, max_bs=8, disable_graphs=not graphs)
        drafter, capture = bench_drafter(engine, layers, [sc for _, sc in settings])
        if graphs:
            print(f"drafter graph capture: {capture}", flush=True)
            ctx.setdefault("drafter_capture", capture)
        prompt = torch.randint(0, engine.model_config.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
        greedy = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        # Warm-up: a fresh engine's first prefill and steps JIT-compile kernels (seconds), which the
        # target-only figure must not include (it would when this section runs first).
        engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True), spec=None)
        rid = engine.add_request(prompt, greedy, spec=None)
        reference_timing = _timed_to_the_end(engine, rid, new_tokens)
        reference = engine.requests.pop(rid).output
        target_only, target_only_decode = reference_timing["tok_s"], reference_timing["decode_tok_s"]
        for kind, sc in (settings if graphs else settings[::2]):  # graphs off: a chain and the tree
            # The reference is the target's greedy continuation *as the verify forward computes it*: a run
            # whose drafts are all corrupted (r = 1) emits exactly the verify root's argmax each round (the
            # bench target's greedy path has wide margins, bench/models.py, so it is also the decode graph's).
            steer = ControlledAcceptanceProposer(drafter, 1.0, seed=1)
            engine.proposer, engine.default_spec = steer, sc
            rid = engine.add_request(prompt, greedy)
            steer.set_reference(rid, len(prompt), reference + [0] * 16)
            while not engine.requests[rid].finished:
                engine.step()
            verify_reference = engine.requests.pop(rid).output
            # With graphs, greedy chains run queued on the device (--spec-rounds, default 4) and also one
            # round per step, for comparison; trees and eager runs always go one round per step.
            queued = engine.spec_rounds
            # (rounds per step, overlapped runs)
            rounds_settings = ((queued, True), (1, True)) if graphs and kind == "chain" and queued > 1 else ((1, True),)
            goals = (4.0,) if goal_only else (2.0, 4.0) if ctx["quick"] or not graphs else (2.0, 3.0, 4.0, 5.0)
            # The goal's own rows alternate the settings three times (runs on one host vary by a few %), and
            # add runs twice as long as the default, and runs read back one at a time (no overlap).
            at_goal = ((*rounds_settings, (2 * queued, True), (queued, False)) if len(rounds_settings) > 1
                       else rounds_settings)
            runs = [(goal, setting) for goal in goals
                    for setting in (at_goal * 3 if goal == 4.0 and len(rounds_settings) > 1 else rounds_settings)]
            for goal, (spec_rounds, overlap) in runs:
                if kind == "tree" and not graphs and goal != 4.0:
                    continue
                if goal > sc.num_steps + 1:
                    continue
                engine.spec_rounds, engine.overlap_runs = spec_rounds, overlap
                rate = rate_for(goal, sc.num_steps)
                proposer = ControlledAcceptanceProposer(drafter, rate, seed=1)
                engine.proposer, engine.default_spec = proposer, sc
                rid = engine.add_request(prompt, greedy)
                proposer.set_reference(rid, len(prompt), verify_reference + [0] * 16, depth=sc.num_steps)
                timing = _timed_to_the_end(engine, rid, new_tokens)
                req = engine.requests.pop(rid)
                agree = next((i for i, (a, b) in enumerate(zip(req.output, reference)) if a != b), len(req.output))
                engine.spec_rounds, engine.overlap_runs = queued, True
                row = {"graphs": graphs, "kind": kind, "steps": sc.num_steps, "topk": sc.topk,
                       "draft_tokens": sc.num_draft_tokens, "goal_accept_length": goal, "spec_rounds": spec_rounds,
                       "overlap_runs": overlap, "accept_length": req.spec_stats.accept_length_mean,
                       "tok_s": timing["tok_s"], "target_only_tok_s": target_only,
                       "speedup": timing["tok_s"] / target_only,
                       # after the first token (the prefill's), as the decode section measures target-only
                       "decode_tok_s": timing["decode_tok_s"], "target_only_decode_tok_s": target_only_decode,
                       "decode_speedup": timing["decode_tok_s"] / target_only_decode,
                       "identical_to_verify_reference": req.output == verify_reference,
                       "tree_depth_max": len(req.spec_stats.drafted_at_depth),
                       "tokens_identical_to_decode_reference": agree}
                rows.append(row)
                print(f"graphs {'on ' if graphs else 'off'} {kind:5s} steps={sc.num_steps} topk={sc.topk} "
                      f"ndt={sc.num_draft_tokens:2d} rounds/step={spec_rounds}{'' if overlap else ' (no overlap)'}: "
                      f"accept {row['accept_length']:.2f} (goal {goal}) -> "
                      f"{row['tok_s']:7.1f} tok/s ({row['speedup']:.2f}x target-only {target_only:.1f}); after the "
                      f"first token {row['decode_tok_s']:7.1f} ({row['decode_speedup']:.2f}x {target_only_decode:.1f}); "
                      f"same tokens as reference: {row['identical_to_verify_reference']}", flush=True)
        if graphs and not ctx["quick"]:
            ctx["round_replays_ms"] = _round_replays_ms(engine, drafter, [sc for kind, sc in settings if kind == "chain"])
            print(f"bare replays at batch 1 (ms): {ctx['round_replays_ms']}", flush=True)
        engine.proposer = None
        engine.shutdown()
        del engine, drafter, proposer
        free_gpu()
    return {"rows": rows, "drafter_capture": ctx.get("drafter_capture"), "round_replays_ms": ctx.get("round_replays_ms")}


def _timed_to_the_end(engine, rid: str, new_tokens: int) -> dict:
    """Step ``rid`` to its end: tokens/s from its submission (prefill included) and after its first token
    (the prefill's step), the rate the decode section reports for target-only decoding."""
    started = time.perf_counter()
    engine.step()  # the prefill and the first token
    first_at, first_tokens = time.perf_counter(), len(engine.requests[rid].output)
    while not engine.requests[rid].finished:
        engine.step()
    ended = time.perf_counter()
    return {"tok_s": new_tokens / (ended - started), "decode_tok_s": (new_tokens - first_tokens) / (ended - first_at)}


def round_graphs(engine, drafter, chains: list) -> dict:
    """The batch-1 graphs a chain round replays, by name — the decode graph too, for comparison — ready
    to replay on their static inputs as they stand."""
    target = engine.executor.runner.graphs
    drafter.graphs.aux.fill_(1)  # the extend's token count (a queued run leaves the next roots there)
    graphs = {"decode": target.graphs[(1, 1)]}
    for sc in chains:
        graphs[f"verify width {sc.num_draft_tokens}"] = target.graphs[(sc.num_draft_tokens, 1)]
        graphs[f"draft {sc.num_steps} steps"] = drafter.graphs.graphs[(sc, 1)]
    graphs["draft_extend"] = drafter.graphs.graphs[("extend", 1)]
    return graphs


def replay_ms(graph, reps: int = 10) -> float:
    """GPU time of one replay, ``reps`` back to back per timing so the host's launch of the next
    overlaps the current one (as in a queued run)."""
    return events_ms(lambda: [graph.replay() for _ in range(reps)], 10) / reps


def _round_replays_ms(engine, drafter, chains: list) -> dict[str, float]:
    """GPU time of each graph a chain round replays, at batch 1."""
    return {name: round(replay_ms(graph), 4) for name, graph in round_graphs(engine, drafter, chains).items()}


def spec_goal(ctx: dict) -> dict:
    """The spec section's goal rows alone: a chain of 3 at accept length 4, graphs on, each setting three
    times interleaved, against target-only in the same section (about a third of the section's time)."""
    return spec({**ctx, "goal_only": True})

