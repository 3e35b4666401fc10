"""The decoder-only transformer of the Llama family: Llama (GQA, llama3 rope), Qwen2 (qkv bias),
Qwen3 (per-head q/k RMSNorm). One implementation; the differences are config flags.

Parameter names mirror the Hugging Face checkpoint except for the fused projections, which
``PACKED_WEIGHTS`` maps back (``q_proj``/``k_proj``/``v_proj`` → ``qkv_proj``, ``gate_proj``/``up_proj``
→ ``gate_up_proj``). ``forward`` returns the final hidden states (pre final-norm) and, when asked, the
EAGLE-3 features: the residual-stream *inputs* of the capture layers, concatenated in ascending order.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tandem.attention.backend import AttentionBackend, attend
from tandem.attention.metadata import AttentionMetadata
from tandem.kv_cache import KVPool, KVSpec
from tandem.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.layers.norm import RMSNorm
from tandem.layers.quantized_linear import linear_format
from tandem.layers.rotary import RotaryEmbedding
from tandem.configs.model import ModelConfig
from tandem.models.loader import load_checkpoint

# checkpoint name fragment -> (our fused module fragment, shard id)
PACKED_WEIGHTS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        p = f"model.layers.{layer_id}.self_attn."
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias,
                                          quant=linear_format(cfg.quantization, p, ("q_proj", "k_proj", "v_proj")))
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias,
                                        quant=linear_format(cfg.quantization, p, ("o_proj",)))
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.head_dim**-0.5

    def input_linear(self) -> QKVParallelLinear:
        """The projection that reads the layer's normalised input (PreNormLayer)."""
        return self.qkv_proj

    def forward(self, x, positions, meta: AttentionMetadata, kv: KVPool, backend: AttentionBackend, projected=None):
        """``projected``: ``qkv_proj(x)`` where the layer computed it (x is then not read)."""
        proj = self.qkv_proj
        qkv = proj(x) if projected is None else projected
        q, k, v = qkv.split([proj.q_size, proj.kv_size, proj.kv_size], dim=-1)
        q = q.view(-1, proj.local_heads, self.head_dim)  # [T, Hq_local, D]
        k = k.view(-1, proj.local_kv_heads, self.head_dim)
        v = v.view(-1, proj.local_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k_pool, v_pool = kv.layer(self.layer_id)
        out = attend(backend, q, k, v, positions, self.rotary, k_pool, v_pool, meta, self.scale)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        p, q = f"model.layers.{layer_id}.mlp.", cfg.quantization
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias,
                                                       quant=linear_format(q, p, ("gate_proj", "up_proj")))
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias,
                                           quant=linear_format(q, p, ("down_proj",)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), swiglu=True)  # silu(gate) * up


class PreNormLayer(nn.Module):
    """A pre-norm decoder layer: subclasses build ``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm`` and ``mlp``; the residual data path is this one."""

    def forward(self, h, residual, positions, meta, kv, backend):
        """``(h, residual)`` → ``(h', residual')``: the residual stream is ``h + residual``, kept split so
        each add is fused into the next norm. Layer 0 gets ``residual=None`` (the stream is ``h``)."""
        first, projected = self.self_attn.input_linear(), None
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        elif first is not None:  # the norm inside the first projection's launch where it can be (linear.py)
            projected, residual, x = first.forward_normed(h, residual, self.input_layernorm)
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(x, positions, meta, kv, backend, projected=projected)
        mlp_normed = getattr(self.mlp, "forward_normed", None)  # (a MoE: the norm inside its router's launch)
        if mlp_normed is not None:
            return mlp_normed(h, residual, self.post_attention_layernorm)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


class DecoderLayer(PreNormLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer_id)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Target model: ``forward`` → (final hidden states, EAGLE-3 features or None); ``logits`` on chosen rows."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    supports_cuda_graphs = True

    def kv_spec(self) -> KVSpec:
        """Per token per layer on this rank: K and V of the local KV heads."""
        return KVSpec(entries=2, heads=self.model.layers[0].self_attn.qkv_proj.local_kv_heads, dim=self.config.head_dim)

    def load(self, model_dir: str | Path) -> None:
        optional = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        load_checkpoint(self, model_dir, PACKED_WEIGHTS, optional=optional, ignored=optional)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv: KVPool,
        backend: AttentionBackend,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.model.embed_tokens(input_ids)  # [T, H]
        residual = None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in capture_layers:  # input of layer i == HF hidden_states[i]
                captured[i] = h if residual is None else h + residual
            h, residual = layer(h, residual, positions, meta, kv, backend)
        h = h + residual  # the final residual stream (pre-norm)
        # [T, len(capture_layers) * H], in the order given (ascending by convention)
        features = torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        return h, features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        return self.lm_head(self.model.norm(hidden))
