"""Write a Hugging Face ``LlamaForCausalLM`` folder with random weights, without transformers.

Used for the embedded demo until a trained demo pair exists, and by benchmarks, which need
Llama-3.1-8B-shaped models on machines where nothing can be downloaded. The folder is a normal HF
checkpoint: transformers loads it (a test checks that our logits equal transformers' on it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tandem.safetensors_file import write_safetensors


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 352
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 500000.0
    tie_word_embeddings: bool = False


LLAMA_8B = LlamaShape(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, max_position_embeddings=131072)


def hf_config(shape: LlamaShape, dtype: str, bos: int | None = None, eos: int | None = None) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype,
    }


def random_llama_state(shape: LlamaShape, dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, d = shape.hidden_size, shape.intermediate_size, shape.hidden_size // shape.num_heads

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * std).to(dtype)

    state = {"model.embed_tokens.weight": rand(shape.vocab_size, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        state.update({
            p + "self_attn.q_proj.weight": rand(shape.num_heads * d, h),
            p + "self_attn.k_proj.weight": rand(shape.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": rand(shape.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": rand(h, shape.num_heads * d),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        })
    if not shape.tie_word_embeddings:
        state["lm_head.weight"] = rand(shape.vocab_size, h)
    return state


def write_random_llama(path: str | Path, shape: LlamaShape, dtype: str = "float32", seed: int = 0,
                       std: float = 0.02, bos: int | None = None, eos: int | None = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    write_safetensors(random_llama_state(shape, torch_dtype, seed, std), path / "model.safetensors",
                      metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(shape, dtype, bos, eos), indent=2))
    return path
