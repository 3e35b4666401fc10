"""Benchmark section ``deepseek``: DeepSeek-V3-architecture targets end to end (random bf16 weights drawn on
the GPU, only config.json written; MLA + MoE on CUDA graphs, in process), each against its own limit: the
bytes of weights one decoded token reads at batch 1 (every layer's attention, the dense MLPs, the routed
experts a token picks plus the shared ones, the router, the LM head) ÷ the measured copy bandwidth.

- the DeepSeek-V2-Lite shape (hidden 2048, 27 layers, 16 heads, kv_lora 512, no q_lora, 64 experts top-6,
  2 shared, expert 1408, vocab 102400, V3 routing): graph capture time and memory at a first start and a second
  (kernels compiled), decode at batch 1 (and
  its share of the limit; goal >= 65 %), 8 and 64; EAGLE-3 (a random head) chain of 3 at controlled accept
  length 3 and 4, batch 1 and 8, beside target-only at the same batch;
- Kimi-K2's dimensions with 4 layers (1 dense + 3 MoE, 384 experts top-8, 64 heads, q_lora 1536): capture,
  decode at batch 1 against its limit.

The byte count (``active_weight_bytes``) is tested on the CPU (tests/test_bench_deepseek.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from measure import decode_tok_s, free_gpu, rate_for, read_seconds
from models import _ROOT
from sections_overlap import _steered_batch

V2_LITE = dict(hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
               q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
               n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
               first_k_dense_replace=1, n_group=1, topk_group=1, vocab_size=102400)
KIMI_K2_4L = dict(hidden_size=7168, intermediate_size=18432, num_hidden_layers=4, num_attention_heads=64,
                  q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
                  first_k_dense_replace=1, n_group=1, topk_group=1, vocab_size=163840)
DECODE_GOAL = 0.65


def deepseek_dir(name: str, fields: dict) -> Path:
    """A config-only DeepseekV3ForCausalLM folder (weights drawn at load: ``load_format="random"``)."""
    path = _ROOT / f"deepseek-{name}"
    if not (path / "config.json").is_file():
        path.mkdir(parents=True, exist_ok=True)
        config = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_act="silu",
                      max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, moe_layer_freq=1,
                      norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc",
                      tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1, **fields)
        (path / "config.json").write_text(json.dumps(config))
    return path


def active_weight_bytes(f: dict, dtype_bytes: int = 2) -> int:
    """Weight bytes one token reads at batch 1 (``f``: the config fields above)."""
    h, heads = f["hidden_size"], f["num_attention_heads"]
    qk = f["qk_nope_head_dim"] + f["qk_rope_head_dim"]
    q = h * heads * qk if not f["q_lora_rank"] else h * f["q_lora_rank"] + f["q_lora_rank"] * heads * qk
    attention = (q + h * (f["kv_lora_rank"] + f["qk_rope_head_dim"])
                 + f["kv_lora_rank"] * heads * (f["qk_nope_head_dim"] + f["v_head_dim"]) + heads * f["v_head_dim"] * h)
    dense = 3 * h * f["intermediate_size"]
    moe = (f["num_experts_per_tok"] + f["n_shared_experts"]) * 3 * h * f["moe_intermediate_size"]
    router = f["n_routed_experts"] * h * 4 // dtype_bytes  # float32
    layers, dense_layers = f["num_hidden_layers"], f["first_k_dense_replace"]
    per_token = layers * attention + dense_layers * dense + (layers - dense_layers) * (moe + router)
    return dtype_bytes * (per_token + f["vocab_size"] * h)


def _engine(path: Path, widths: tuple[int, ...], max_bs: int, kv_pages: int):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.speculative.policy import PolicyConfig, SpeculationPolicy

    cfg = EngineConfig(model=str(path), device="cuda", dtype="bfloat16", load_format="random", cuda_graph_widths=widths,
                       cuda_graph_max_bs=max_bs, kv_pages=kv_pages)
    return LLMEngine(cfg, policy=SpeculationPolicy(PolicyConfig(enabled=False)))  # (the instrument: every round)


def _copy_tbps(ctx: dict) -> float:
    if "copy_tbps" not in ctx:
        from sections import ceilings

        ceilings(ctx)
    return ctx["copy_tbps"]


def _decode_rows(engine, fields: dict, batches: tuple[int, ...], new_tokens: int, copy_tbps: float) -> list[dict]:
    limit = 1 / read_seconds(active_weight_bytes(fields), copy_tbps)
    rows = []
    decode_tok_s(engine, 1, 8)  # warm-up: the first steps compile kernels
    for bs in batches:
        row = decode_tok_s(engine, bs, new_tokens)
        if bs == 1:
            row["limit_tok_s"], row["of_limit"] = limit, row["tok_s"] / limit
        rows.append(row)
        print(f"  decode batch {bs:3d}: {row['tok_s']:9.1f} tok/s" + (
            f" = {row['of_limit']:.1%} of its limit {limit:.0f} tok/s (goal >= {DECODE_GOAL:.0%})" if bs == 1 else ""),
            flush=True)
    return rows


def _speculation_rows(engine, path: Path, batches: tuple[int, ...], goals: tuple[float, ...], new_tokens: int) -> list:
    from models import random_draft
    from tandem.sampling import SamplingParams
    from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter, SpecConfig

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


def deepseek(ctx: dict) -> dict:
    from tandem.errors import ConfigError

    quick = ctx["quick"]
    copy_tbps, out = _copy_tbps(ctx), {}
    lite = dict(V2_LITE, num_hidden_layers=ctx.get("layers") or V2_LITE["num_hidden_layers"])
    # (name, fields, decode batches, whether to speculate and to start twice: the second start's capture has
    # its kernels compiled, which the goal asks for)
    cases = (("v2-lite", lite, (1, 8) if quick else (1, 8, 64), True), ("kimi-k2-4l", KIMI_K2_4L, (1,), False))
    for name, fields, batches, full in cases:
        path = deepseek_dir(f"{name}-{fields['num_hidden_layers']}l", fields)
        print(f"{name} ({fields['num_hidden_layers']} layers, {active_weight_bytes(fields) / 1e9:.2f} GB read per "
              f"token at batch 1):", flush=True)
        widths = (1, 4) if full else (1,)
        try:
            engine = _engine(path, widths, max(batches), kv_pages=2048)
            first_start = engine.executor.runner.graph_report
            if full:
                engine.shutdown()
                del engine
                free_gpu()
                engine = _engine(path, widths, max(batches), kv_pages=2048)
        except (torch.cuda.OutOfMemoryError, ConfigError) as e:  # Kimi-K2's bf16 experts fill most of one GPU
            print(f"  could not start: {e}", flush=True)  # (a capture's out-of-memory comes as a ConfigError)
            out[name] = {"fields": fields, "error": str(e)}
            free_gpu()
            continue
        report = engine.executor.runner.graph_report
        print(f"  graph capture: first start {first_start}" + (f", started again {report}" if full else ""),
              flush=True)
        out[name] = {"fields": fields, "active_weight_bytes": active_weight_bytes(fields), "capture": report,
                     "capture_first_start": first_start,
                     "decode": _decode_rows(engine, fields, batches, 32 if quick else 128, copy_tbps)}
        if full:
            out[name]["speculation"] = _speculation_rows(engine, path, (1,) if quick else (1, 8),
                                                         (4.0,) if quick else (3.0, 4.0), 48 if quick else 160)
        engine.shutdown()
        del engine
        free_gpu()
    return out
