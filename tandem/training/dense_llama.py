"""A dense causal Llama for training, with the parameter names of HF ``LlamaForCausalLM``.

The serving model (tandem.models.llama) is built for inference: paged KV, fused and sharded
projections, frozen parameters. Training wants plain ``nn.Linear`` layers, whole sequences and
autograd, so this is a separate twin — but its ``state_dict()`` *is* an HF checkpoint
(``model.layers.0.self_attn.q_proj.weight`` ...), so ``save_hf_folder`` writes a folder that both our
engine and transformers load (a test checks their logits agree).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tandem.safetensors_file import write_safetensors
from torch import nn

from tandem.layers.rotary import inverse_frequencies
from tandem.configs.model import RopeConfig
from tandem.models.random_checkpoint import LlamaShape, hf_config


@dataclass(frozen=True)
class LlamaDims:
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    context: int = 256  # trained sequence length = max_position_embeddings of the saved config
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def shape(self) -> LlamaShape:
        return LlamaShape(self.vocab_size, self.hidden_size, self.intermediate_size, self.num_layers,
                          self.num_heads, self.num_kv_heads, self.context, self.rope_theta, False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # float32 statistics like HF's LlamaRMSNorm, so bf16 autocast training saves an equivalent model
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotary_tables(head_dim: int, positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [positions, head_dim] with HF's layout (frequencies repeated, rotate-half pairing)."""
    inv = inverse_frequencies(head_dim, RopeConfig(theta=theta))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D]; cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, d: LlamaDims):
        super().__init__()
        self.d = d
        self.q_proj = nn.Linear(d.hidden_size, d.num_heads * d.head_dim, bias=False)
        self.k_proj = nn.Linear(d.hidden_size, d.num_kv_heads * d.head_dim, bias=False)
        self.v_proj = nn.Linear(d.hidden_size, d.num_kv_heads * d.head_dim, bias=False)
        self.o_proj = nn.Linear(d.num_heads * d.head_dim, d.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        d, (B, T, _) = self.d, x.shape
        q = self.q_proj(x).view(B, T, d.num_heads, d.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_proj(x).view(B, T, d.num_kv_heads, d.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, d.num_kv_heads, d.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # keep bf16 under autocast (fp32 tables would upcast q/k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=d.num_heads != d.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, d: LlamaDims):
        super().__init__()
        self.gate_proj = nn.Linear(d.hidden_size, d.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d.hidden_size, d.intermediate_size, bias=False)
        self.down_proj = nn.Linear(d.intermediate_size, d.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, d: LlamaDims):
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.self_attn = Attention(d)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.mlp = MLP(d)

    def forward(self, h, cos, sin):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Body(nn.Module):
    """HF's ``model.`` submodule: embeddings, layers, final norm."""

    def __init__(self, d: LlamaDims):
        super().__init__()
        self.embed_tokens = nn.Embedding(d.vocab_size, d.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(d) for _ in range(d.num_layers))
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)


class DenseLlama(nn.Module):
    def __init__(self, d: LlamaDims):
        super().__init__()
        self.dims = d
        self.model = Body(d)
        self.lm_head = nn.Linear(d.hidden_size, d.vocab_size, bias=False)
        cos, sin = rotary_tables(d.head_dim, d.context, d.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_weights(self, seed: int) -> None:
        """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2·layers) so the
        residual stream does not grow with depth; norms at 1."""
        g = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / (2 * self.dims.num_layers) ** 0.5
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    std = resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> logits [B, T, V]
        T = input_ids.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin)
        return self.lm_head(self.model.norm(h))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over a [B, T+1] window."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def save_hf_folder(model: DenseLlama, out_dir: str | Path, bos: int | None, eos: int | None,
                   dtype: str = "float32", extra: dict | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (HF names); tokenizer files are the caller's."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    state = {k: v.detach().to("cpu", torch_dtype).contiguous() for k, v in model.state_dict().items()}
    write_safetensors(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg = hf_config(model.dims.shape(), dtype, bos, eos)
    cfg["rms_norm_eps"] = model.dims.rms_norm_eps
    cfg["tandem_training"] = {"dims": asdict(model.dims), **(extra or {})}  # provenance; loaders ignore it
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
