"""Tiny random DeepSeek-V3 checkpoints written by transformers' own save_pretrained (float32, eager
attention), and the Kimi-K2.5 wrapper folder built from one (../shared/reference/deepseek_v3_kimi.md §4, §8)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# §8's tiny shape: v_head_dim != qk_nope_head_dim (catches split bugs), n_group 2 of topk_group 1, YaRN on.
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=8, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            rms_norm_eps=1e-6, max_position_embeddings=16384, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32.0, "beta_slow": 1.0})


def deepseek_config(**overrides):
    from transformers import DeepseekV3Config

    kw = dict(TINY)
    kw.update(overrides)
    cfg = DeepseekV3Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def write_deepseek(path: Path, seed: int = 0, **overrides):
    """A random float32 DeepseekV3ForCausalLM saved to ``path``; returns the transformers model (eval)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(deepseek_config(**overrides)).to(torch.float32).eval()
    with torch.no_grad():  # widen the tiny init so greedy paths are decisive and routing is not a coin toss
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in name:  # not all ones, so a norm applied in the wrong place shows
                p.normal_(1.0, 0.1)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:  # zeros by default: randomise so selection differs from the weights' order
                gate.e_score_correction_bias.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model


def write_kimi_k25(src: Path, dst: Path) -> None:
    """The Kimi-K2.5 wrapper layout of a DeepSeek-V3 folder: config with text_config (model_type kimi_k2),
    tensors under language_model., a vision tower and projector the text-only server must skip."""
    dst.mkdir(parents=True, exist_ok=True)
    text = json.loads((src / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    text.pop("architectures", None)
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
              "vision_config": {"model_type": "moonvit", "hidden_size": 32}, "eos_token_id": text.get("eos_token_id")}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {f"language_model.{k}": v for k, v in load_file(str(src / "model.safetensors")).items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(32, 3, 2, 2)
    tensors["mm_projector.linear_1.weight"] = torch.randn(64, 32)
    save_file(tensors, str(dst / "model.safetensors"))
