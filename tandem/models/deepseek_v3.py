"""DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 (text): multi-head latent attention (MLA) over a latent KV cache,
noaux_tc mixture of experts after ``first_k_dense_replace`` dense layers.

Parameter names mirror the Hugging Face checkpoint, with the dense MLPs' and experts' gate/up fused, and
attention's q_proj or q_a_proj with kv_a_proj_with_mqa where they can share a weight (``packed_weights``).
The cache holds one latent entry per token per layer (``kv_spec``); attention runs in the absorbed form
(MQA over the latents: ``W_UK`` folded into the query, ``W_UV`` applied to the attended latent) except for
forwards of fresh prompts, which use the plain form (../shared/reference/deepseek_v3_kimi.md §2).
``forward``/``logits`` are the dense model's: the same residual-stream loop, with the same EAGLE-3 capture
(inputs of the capture layers).

Quantized checkpoints (§5): every linear takes the format ``cfg.quantization`` gives its checkpoint
name (prefix included, as the ignore lists name them): FP8 block-wise everywhere (DeepSeek-V3, Kimi-K2),
INT4 on the routed experts only (Kimi-K2.5); the router and the LM head stay unquantized.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import nn

from tandem.attention.metadata import AttentionMetadata
from tandem.kv_cache import KVPool, KVSpec
from tandem.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, matmul
from tandem.layers.mla_qkv_a import QKVAProjection, can_fuse, q_local_rows
from tandem.layers.moe import MoE, SwiGLUMLP
from tandem.layers.norm import RMSNorm
from tandem.layers.quantized_linear import linear_format
from tandem.layers.yarn_rotary import YarnRotary
from tandem.configs.model import ModelConfig
from tandem.models.llama import PACKED_WEIGHTS as LLAMA_PACKED, CausalLM, PreNormLayer
from tandem.models.loader import load_checkpoint

log = logging.getLogger("tandem.models")

KV_A = "kv_a_proj_with_mqa"
GATE_UP = {k: v for k, v in LLAMA_PACKED.items() if k in ("gate_proj", "up_proj")}
# DeepSeek's (and transformers') q_a/kv_a norms use 1e-6 whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: YarnRotary):
        super().__init__()
        m = cfg.mla
        self.layer_id, self.mla, self.rotary = layer_id, m, rotary
        h, heads = cfg.hidden_size, cfg.num_heads
        p = f"{cfg.checkpoint_prefix}model.layers.{layer_id}.self_attn."

        def fmt(name: str):
            return linear_format(cfg.quantization, p, (name,))

        # x's two projections (q_proj or q_a_proj, and kv_a) in one matmul where they can share a weight
        self.fused_qkv_a_proj_with_mqa = fused_q_kv_a(cfg, p)
        if self.fused_qkv_a_proj_with_mqa is None:
            if m.q_lora_rank is None:
                self.q_proj = ColumnParallelLinear(h, heads * m.qk_head_dim, quant=fmt("q_proj"))
            else:
                self.q_a_proj = ReplicatedLinear(h, m.q_lora_rank, bias=m.attention_bias, quant=fmt("q_a_proj"))
            self.kv_a_proj_with_mqa = ReplicatedLinear(h, m.cache_dim, bias=m.attention_bias, quant=fmt(KV_A))
        if m.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, heads * m.qk_head_dim, quant=fmt("q_b_proj"))
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim),
                                              quant=fmt("kv_b_proj"))
        self.o_proj = RowParallelLinear(heads * m.v_head_dim, h, bias=m.attention_bias, quant=fmt("o_proj"))
        self.local_heads = self.kv_b_proj.local_out // (m.qk_nope_head_dim + m.v_head_dim)
        self.scale = m.softmax_scale
        self._kv_b_dense: torch.Tensor | None = None

    def input_linear(self) -> QKVAProjection | None:
        """The projection that reads the layer's normalised input, where one does (PreNormLayer)."""
        return self.fused_qkv_a_proj_with_mqa

    def project_q_kv_a(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_proj(x) or q_a_proj(x), kv_a_proj_with_mqa(x))``: one matmul where fused."""
        if self.fused_qkv_a_proj_with_mqa is not None:
            return self.fused_qkv_a_proj_with_mqa(x)
        q_in = self.q_proj if self.mla.q_lora_rank is None else self.q_a_proj
        return q_in(x), self.kv_a_proj_with_mqa(x)

    def kv_b_weight(self) -> torch.Tensor:
        """This rank's kv_b_proj weight [heads·(nope + v), kv_lora] in the model's dtype. A quantized one is
        dequantized once, at load (``finish_load``; here on first use for random weights), and kept dense
        beside its packed form, as SGLang does: the absorbed form slices it per head into W_UK and W_UV
        and folds them into einsums, which no packed GEMM computes; it is small (Kimi: 16 MB a layer in bf16)."""
        if self.kv_b_proj.quant is None:
            return self.kv_b_proj.weight
        if self._kv_b_dense is None:
            self.finish_load()
        return self._kv_b_dense

    def finish_load(self) -> None:
        if self.kv_b_proj.quant is not None:
            dtype = self.kv_a_layernorm.weight.dtype  # the model's dtype (norms are never quantized)
            self._kv_b_dense = self.kv_b_proj.quant.dequantize(self.kv_b_proj, dtype)

    def forward(self, x, positions, meta: AttentionMetadata, kv: KVPool, backend, projected=None) -> torch.Tensor:
        """``projected``: ``project_q_kv_a(x)`` where the layer computed it (x is then not read)."""
        m, heads = self.mla, self.local_heads
        # [T, heads·qk_head_dim or q_lora], [T, kv_lora + rope]
        q, kv_a = self.project_q_kv_a(x) if projected is None else projected
        if m.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(-1, heads, m.qk_head_dim)
        pool, _ = kv.layer(self.layer_id)
        absorb = None  # the kernels for a few rows (tandem/kernels/mla_absorb.py), else the einsums
        if backend.fused_absorb and not backend.plain_prefill:
            from tandem.kernels import mla_absorb

            absorb = mla_absorb if q.shape[0] <= mla_absorb.MAX_ROWS else None
        prologue = None  # norm, both rotaries and the store in one launch (in place in q and kv_a) ...
        if backend.fused_prologue:
            from tandem.kernels.mla_prologue import Prologue, mla_prologue

            norm = self.kv_a_layernorm
            prologue = Prologue(kv_a, norm.weight, norm.eps, self.rotary.cos, self.rotary.sin, positions, pool,
                                meta.slot_mapping, self.rotary.interleave)
            if absorb is None or not absorb.PROLOGUE_IN_ABSORB_Q:  # ... or inside absorb_q's (q left unrotated)
                mla_prologue(q, *prologue)
                prologue = None
        else:
            c_kv, k_pe = kv_a.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
            kv_a = torch.cat([self.kv_a_layernorm(c_kv), self.rotary(positions, k_pe)], dim=-1)
            q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
            q = torch.cat([q_nope, self.rotary(positions, q_pe)], dim=-1)
            backend.store(kv_a, pool, meta)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = kv_a.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        # kv_b_proj rows per head: [W_UK (nope) ; W_UV (v)], each over the kv_lora latent.
        w_kv_b = self.kv_b_weight()
        w_uk, w_uv = w_kv_b.view(heads, -1, m.kv_lora_rank).split([m.qk_nope_head_dim, m.v_head_dim], 1)
        if backend.plain_prefill:
            k_nope, v = matmul(c_kv, w_kv_b).view(-1, heads, m.qk_nope_head_dim + m.v_head_dim).split(
                [m.qk_nope_head_dim, m.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, heads, -1)], dim=-1)
            out = backend.forward_plain(q, k, v, meta, self.scale)
        else:
            if absorb is not None:
                q_absorbed = absorb.absorb_q(q, w_uk, m.kv_lora_rank, prologue)  # [q_nope W_UK, q_pe]
            else:
                q_absorbed = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_uk), q_pe], dim=-1)
            # [T, H, kv_lora] (or its splits unmerged, for the absorb kernel to merge: mla_absorb.MERGE_SPLITS_HERE)
            attended = backend.forward_absorbed(q_absorbed, pool, meta, self.scale, m.kv_lora_rank,
                                                merge=absorb is None or not absorb.MERGE_SPLITS_HERE)
            if absorb is not None:
                out = absorb.absorb_out(attended, w_uv)
            else:
                out = torch.einsum("thc,hvc->thv", attended, w_uv)
        return self.o_proj(out.flatten(1))


def fused_q_kv_a(cfg: ModelConfig, prefix: str) -> QKVAProjection | None:
    """The layer's q_proj (V2 style, by heads) or q_a_proj fused with kv_a_proj_with_mqa, or None where
    they cannot share a weight: formats that differ or do not align (tandem/layers/mla_qkv_a.py), or
    q_proj beside kv_a biases (transformers' q_proj has none)."""
    m = cfg.mla
    q_sharded = m.q_lora_rank is None
    q_name, q_size = ("q_proj", cfg.num_heads * m.qk_head_dim) if q_sharded else ("q_a_proj", m.q_lora_rank)
    formats = [linear_format(cfg.quantization, prefix, (name,)) for name in (q_name, KV_A)]
    if (q_sharded and m.attention_bias) or not can_fuse(*formats, q_local_rows(q_size, q_sharded)):
        return None
    return QKVAProjection(cfg.hidden_size, q_size, m.cache_dim, q_sharded, m.attention_bias,
                          linear_format(cfg.quantization, prefix, (q_name, KV_A)))


class DeepseekDecoderLayer(PreNormLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: YarnRotary):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe is not None and cfg.moe.is_moe_layer(layer_id)
        p, q = f"{cfg.checkpoint_prefix}model.layers.{layer_id}.mlp.", cfg.quantization
        self.mlp = MoE(cfg.hidden_size, cfg.moe, q, p) if moe else SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, q, p)


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        rotary = YarnRotary(cfg.mla, cfg.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(CausalLM):
    """Target model with CausalLM's ``forward`` and ``logits`` (they only walk ``model`` and ``lm_head``)."""

    supports_cuda_graphs = True  # decode and verify through tandem.attention.mla_graph_backend

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)  # not CausalLM.__init__: that builds the dense decoder
        self.config = cfg
        self.model = DeepseekModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def kv_spec(self) -> KVSpec:
        return KVSpec(entries=1, heads=1, dim=self.config.mla.cache_dim)  # every rank holds the whole latent

    def load(self, model_dir: str | Path) -> None:
        cfg = self.config
        optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
        skipped = load_checkpoint(self, model_dir, packed_weights(cfg), optional=optional, ignored=optional,
                                  rename=checkpoint_rename(cfg))
        for layer in self.model.layers:
            layer.self_attn.finish_load()
        if skipped:
            log.info("%s: skipped %d tensors the text model does not use: %s", model_dir, len(skipped),
                     ", ".join(sorted({_group(n) for n in skipped})))


def packed_weights(cfg: ModelConfig) -> dict[str, tuple[str, object]]:
    """Checkpoint module → (fused module, part): gate/up, and the query's first projection with kv_a (a
    layer that keeps them apart loads them as they are: tandem/models/loader.py)."""
    q_name = "q_proj" if cfg.mla.q_lora_rank is None else "q_a_proj"
    return {**GATE_UP, q_name: ("fused_qkv_a_proj_with_mqa", "q"), KV_A: ("fused_qkv_a_proj_with_mqa", "kv")}


def checkpoint_rename(cfg: ModelConfig):
    """Checkpoint name → ours: the wrapper's prefix dropped; None for what a text-only target skips
    (outside the prefix: vision tower, projector; DeepSeek-V3's MTP layer ``model.layers.<N>``)."""
    prefix, num_layers = cfg.checkpoint_prefix, cfg.num_layers

    def rename(name: str) -> str | None:
        if not name.startswith(prefix):
            return None
        name = name[len(prefix):]
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        return None if layer and int(layer.group(1)) >= num_layers else name

    return rename


def _group(name: str) -> str:
    """A skipped tensor's family for the log line: ``vision_tower.*``, ``model.layers.61.*``."""
    layer = re.match(r"(.*?model\.layers\.\d+)\.", name)
    return (layer.group(1) if layer else name.split(".")[0]) + ".*"
