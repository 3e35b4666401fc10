"""Tiny random checkpoints written by transformers' own save_pretrained, for reference comparisons."""

from __future__ import annotations

from pathlib import Path

import torch

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


def llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(SMALL, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
              bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return LlamaConfig(**kw)


def qwen2_config(**overrides):
    from transformers import Qwen2Config

    kw = dict(SMALL, tie_word_embeddings=True, eos_token_id=2)
    kw.update(overrides)
    return Qwen2Config(**kw)


def qwen3_config(**overrides):
    from transformers import Qwen3Config

    kw = dict(SMALL, head_dim=32, tie_word_embeddings=True, eos_token_id=2)
    kw.update(overrides)
    return Qwen3Config(**kw)


CONFIGS = {"llama": llama_config, "qwen2": qwen2_config, "qwen3": qwen3_config}


def write_checkpoint(path: Path, family: str, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Save a random float32 model of ``family`` to ``path``; returns the HF model (eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = CONFIGS[family](**overrides)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    # Random init gives tiny weights and nearly uniform logits; widen them so greedy paths are decisive.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "bias" in name:
                p.normal_(0, 0.05)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return model
