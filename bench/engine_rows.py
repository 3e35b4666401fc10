"""What the sections on whole random-weight targets share (bench/sections_deepseek.py,
bench/sections_quant_engines.py): the engine on CUDA graphs, the measured copy rate, decode rows against
a target's read limit, and EAGLE-3 chain speculation at controlled acceptance (a random head)."""

from __future__ import annotations

from pathlib import Path

import torch

from measure import decode_tok_s, rate_for, read_seconds
from sections_overlap import _steered_batch


def random_weight_engine(path: Path, widths: tuple[int, ...], max_bs: int, kv_pages: int):
    """The target in ``path`` (config only) with random weights drawn on the GPU, its graphs captured."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.speculative.policy import PolicyConfig, SpeculationPolicy

    cfg = EngineConfig(model=str(path), device="cuda", dtype="bfloat16", load_format="random", cuda_graph_widths=widths,
                       cuda_graph_max_bs=max_bs, kv_pages=kv_pages)
    return LLMEngine(cfg, policy=SpeculationPolicy(PolicyConfig(enabled=False)))  # (the instrument: every round)


def copy_tbps_of(ctx: dict) -> float:
    """The measured copy rate (the ``ceilings`` section's, run now if it has not run)."""
    if "copy_tbps" not in ctx:
        from sections import ceilings

        ceilings(ctx)
    return ctx["copy_tbps"]


def decode_rows(engine, weight_bytes: int, goal: float, batches: tuple[int, ...], new_tokens: int,
                copy_tbps: float) -> list[dict]:
    """Decode tok/s at each batch; at batch 1 also its share of the limit, ``weight_bytes`` read per token."""
    limit = 1 / read_seconds(weight_bytes, copy_tbps)
    rows = []
    decode_tok_s(engine, 1, 8)  # warm-up: the first steps compile kernels
    for bs in batches:
        row = decode_tok_s(engine, bs, new_tokens)
        if bs == 1:
            row["limit_tok_s"], row["of_limit"] = limit, row["tok_s"] / limit
        rows.append(row)
        print(f"  decode batch {bs:3d}: {row['tok_s']:9.1f} tok/s" + (
            f" = {row['of_limit']:.1%} of its limit {limit:.0f} tok/s (goal >= {goal:.0%})" if bs == 1 else ""),
            flush=True)
    return rows


def speculation_rows(engine, path: Path, batches: tuple[int, ...], goals: tuple[float, ...], new_tokens: int) -> list:
    """EAGLE-3 chain of 3 with a random head whose drafts are steered to accept ``goals`` tokens a round
    on average, against the target alone at the same batch."""
    from models import random_draft
    from tandem.sampling import SamplingParams
    from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
    from tandem.speculative.spec_config import SpecConfig

    runner, spec = engine.executor.runner, SpecConfig(3, 1, 4)
    drafter = Eagle3Drafter.from_dirs(str(random_draft(path, runner.capture_layers)), str(path),
                                      DrafterConfig(device="cuda", dtype="bfloat16", cuda_graph_max_bs=max(batches),
                                                    defer_chain_tokens=True),
                                      capture_layers=runner.capture_layers,
                                      embed_weight=runner.model.model.embed_tokens.weight)
    drafter.capture_cuda_graphs([spec], pool=runner.graphs.pool)
    vocab, rows = engine.model_config.vocab_size, []
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for bs in batches:
        g = torch.Generator().manual_seed(bs)
        prompts = [torch.randint(0, vocab, (128,), generator=g).tolist() for _ in range(bs)]
        engine.proposer = None  # the target alone
        target_only = decode_tok_s(engine, bs, new_tokens)["tok_s"]
        # the verify path's own greedy continuation (every draft corrupted), which the steered drafts then follow
        references, _, _ = _steered_batch(engine, drafter, spec, prompts, params, 1.0, [[0]] * bs)
        for goal in goals:
            _, tok_s, accept = _steered_batch(engine, drafter, spec, prompts, params, rate_for(goal, spec.num_steps),
                                              references)
            rows.append({"batch": bs, "goal_accept_length": goal, "accept_length": accept, "tok_s": tok_s,
                         "target_only_tok_s": target_only, "x_target_only": tok_s / target_only})
            print(f"  chain of 3, batch {bs}, accept {accept:.2f} (goal {goal}): {tok_s:8.1f} tok/s = "
                  f"{tok_s / target_only:.2f}x target-only ({target_only:.1f})", flush=True)
    engine.proposer = None
    return rows
