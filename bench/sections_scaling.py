"""Benchmark sections beyond one process and one GPU: the service pair, and tensor parallelism."""

from __future__ import annotations

import time

import torch

from models import LLAMA_8B_SHAPE, bench_drafter, bench_engine, random_draft, target_dir
from sections import _decode_tok_s, _free_gpu
from service_pair import round_parts, round_parts_ms, service_pair


def service(ctx: dict) -> dict:
    """The drafter and verifier as separate services (rounds on the round lane, then on the gRPC stream;
    features through the shared-memory ring) against the same engine and head in one process, same
    settings, batch 1. Random head: acceptance is what it is (~1),
    which isolates the per-round cost of the service boundary."""
    from safetensors.torch import save_file

    from tandem.sampling import SamplingParams
    from tandem.speculative.drafter import SpecConfig

    layers = ctx.get("layers") or LLAMA_8B_SHAPE["num_layers"]
    new_tokens = 48 if ctx["quick"] else 128
    spec = SpecConfig(3, 1, 4)
    tdir = target_dir(layers)
    if not (tdir / "model.safetensors").exists():  # the drafter reads the target's embedding from disk
        emb = torch.randn(LLAMA_8B_SHAPE["vocab_size"], LLAMA_8B_SHAPE["hidden_size"], dtype=torch.bfloat16) * 0.02
        save_file({"model.embed_tokens.weight": emb}, str(tdir / "model.safetensors"))
    prompt = torch.randint(0, LLAMA_8B_SHAPE["vocab_size"], (128,), generator=torch.Generator().manual_seed(0)).tolist()

    # In process.
    engine = bench_engine(layers, widths=(1, spec.num_draft_tokens), max_bs=8)
    runner = engine.executor.runner
    drafter, _ = bench_drafter(engine, layers, [spec])
    draft_dir = random_draft(tdir, runner.capture_layers)  # the same folder, for the drafter service
    engine.proposer, engine.default_spec = drafter, spec
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
    started = time.perf_counter()
    res = engine.generate([prompt], params)[0]
    inproc = new_tokens / (time.perf_counter() - started)
    rounds_in = res.spec_stats.rounds
    engine.proposer = None
    engine.shutdown()
    del engine, drafter, runner
    _free_gpu()
    print(f"in process:   {inproc:7.1f} tok/s ({rounds_in} rounds, accept {res.spec_stats.accept_length_mean:.2f})", flush=True)

    # As services: rounds on the round lane (the default) and on the gRPC stream (DESIGN §2's transport).
    flags = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    out = {"in_process_tok_s": inproc, "rounds_in_process": rounds_in, "transports": {}}
    for transport, extra in (("lane", []), ("stream", ["--disable-round-lane"])):
        with service_pair(tdir, draft_dir, "cuda", "bfloat16", flags,
                          verifier_flags=["--load-format", "random", "--kv-pages", "2048", "--cuda-graph-max-bs", "8",
                                          *extra],
                          drafter_flags=["--cuda-graph-max-bs", "8"]) as (generate, m_port):
            generate(prompt, 32)  # warm-up: the drafter's first rounds (allocator growth, first eager extend)
            started = time.perf_counter()
            before = round_parts(m_port)
            last = generate(prompt, new_tokens)
            served = new_tokens / (time.perf_counter() - started)
            after = round_parts(m_port)
        parts = round_parts_ms(before, after)
        per_round_ms = (1e3 * new_tokens / served - 1e3 * new_tokens / inproc) / max(1, last.spec.rounds)
        print(f"{transport}: per round, as the verifier sees it: drafter work {parts['drafter']:.3f} ms (extend "
              f"{parts['extend']:.3f}, draft and waiting for its tokens {parts['draft']:.3f}), "
              f"the rest of the round trip {parts['boundary']:.3f} ms", flush=True)
        print(f"{transport}: as services {served:7.1f} tok/s ({last.spec.rounds} rounds, accept "
              f"{last.spec.accept_length_mean:.2f}); service pair at {served / inproc:.1%} of in process; boundary cost "
              f"{per_round_ms:.3f} ms/round", flush=True)
        out["transports"][transport] = {"service_tok_s": served, "ratio": served / inproc,
                                        "rounds_service": last.spec.rounds, "boundary_ms_per_round": per_round_ms,
                                        "round_trip_parts_ms": parts}
    out.update(out["transports"]["lane"])  # the default transport's figures at the top level, as before
    return out


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
            row = {"tp": size, **_decode_tok_s(engine, bs, 32 if ctx["quick"] else 64)}
            out["rows"].append(row)
            print(f"70B shape, {layers} layers, TP={size}, batch {bs}: {row['tok_s']:8.1f} tok/s "
                  f"({row['ms_per_step']:.2f} ms/step)", flush=True)
        engine.shutdown()
        del engine
        _free_gpu()
    return out

