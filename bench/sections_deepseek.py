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

from engine_rows import copy_tbps_of, decode_rows, random_weight_engine, speculation_rows
from measure import free_gpu
from models import _ROOT
from quant_schemes import MatrixBytes, dense_bytes

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


def active_weight_bytes(f: dict, dtype_bytes: int = 2, routed: MatrixBytes | None = None) -> int:
    """Weight bytes one token reads at batch 1 (``f``: the config fields above; ``routed``: the bytes of one
    [rows, cols] routed-expert matrix in the target's format, bf16 by default; the rest is bf16, the router
    float32). The engine's fused matrices (gate/up) count as one each."""
    h, heads, rope = f["hidden_size"], f["num_attention_heads"], f["qk_rope_head_dim"]
    qk, lora, v = f["qk_nope_head_dim"] + rope, f["kv_lora_rank"], f["v_head_dim"]
    dense = dense_bytes(dtype_bytes)
    routed = routed or dense
    lq = f["q_lora_rank"]
    q = dense(lq, h) + dense(heads * qk, lq) if lq else dense(heads * qk, h)
    attention = q + dense(lora + rope, h) + dense(heads * (f["qk_nope_head_dim"] + v), lora) + dense(h, heads * v)

    def swiglu(matrix: MatrixBytes, inner: int) -> int:
        return matrix(2 * inner, h) + matrix(h, inner)

    shared, mi = f["n_shared_experts"] * f["moe_intermediate_size"], f["moe_intermediate_size"]
    moe = f["num_experts_per_tok"] * swiglu(routed, mi) + (swiglu(dense, shared) if shared else 0)
    router = 4 * f["n_routed_experts"] * h  # float32
    layers, dense_layers = f["num_hidden_layers"], f["first_k_dense_replace"]
    return (layers * attention + dense_layers * swiglu(dense, f["intermediate_size"])
            + (layers - dense_layers) * (moe + router) + dense(f["vocab_size"], h))


def deepseek(ctx: dict) -> dict:
    from tandem.errors import ConfigError

    quick = ctx["quick"]
    copy_tbps, out = copy_tbps_of(ctx), {}
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
            engine = random_weight_engine(path, widths, max(batches), kv_pages=2048)
            first_start = engine.executor.runner.graph_report
            if full:
                engine.shutdown()
                del engine
                free_gpu()
                engine = random_weight_engine(path, widths, max(batches), kv_pages=2048)
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
                     "decode": decode_rows(engine, active_weight_bytes(fields), DECODE_GOAL, batches,
                                           32 if quick else 128, copy_tbps)}
        if full:
            out[name]["speculation"] = speculation_rows(engine, path, (1,) if quick else (1, 8),
                                                         (4.0,) if quick else (3.0, 4.0), 48 if quick else 160)
        engine.shutdown()
        del engine
        free_gpu()
    return out
