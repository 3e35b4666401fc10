"""The DeepSeek-V3 family's config fields (MLA, YaRN, noaux_tc MoE), read once into frozen dataclasses.

Covers ``DeepseekV3ForCausalLM`` (also Kimi-K2's ``model_type: kimi_k2`` and DeepSeek-V2-style configs
with ``q_lora_rank: null``) and the Kimi-K2.5 wrapper ``KimiK25ForConditionalGeneration``, whose
``text_config`` is such a config and whose language-model tensors sit under ``language_model.``
(../shared/reference/deepseek_v3_kimi.md §1). Torch-free, like ``tandem.configs.model``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tandem.errors import CheckpointError
from tandem.configs.fields import decoder_dims, required_field
from tandem.configs.rope_fields import rope_params, rope_theta, rope_type

DEEPSEEK_ARCHITECTURE = "DeepseekV3ForCausalLM"
KIMI_K25_ARCHITECTURE = "KimiK25ForConditionalGeneration"
DEEPSEEK_ARCHITECTURES = (DEEPSEEK_ARCHITECTURE, KIMI_K25_ARCHITECTURE)
KIMI_K25_PREFIX = "language_model."  # where the wrapper keeps the text model's tensors


@dataclass(frozen=True)
class YarnConfig:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # multiplies cos/sin
    mscale_all_dim: float = 0.0  # the softmax scale is multiplied by mscale(factor, mscale_all_dim)^2 when set


@dataclass(frozen=True)
class MlaConfig:
    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite) instead of q_a_proj/q_a_layernorm/q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_interleave: bool  # GPT-J style pairs (DeepSeek, Kimi); False: rotate_half
    yarn: YarnConfig | None
    attention_bias: bool  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """One latent entry per token per layer: normalised c_kv then the rotated k_pe (576 for Kimi)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim^-1/2`` (the width before absorption, not cache_dim's) times YaRN's correction."""
        scale = self.qk_head_dim**-0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            m = yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim)
            scale *= m * m
        return scale


@dataclass(frozen=True)
class MoeConfig:
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def text_config(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The DeepSeek-V3 config inside ``raw`` (the wrapper's ``text_config``, or ``raw`` itself)."""
    if arch != KIMI_K25_ARCHITECTURE:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{source}: {arch} without a text_config (the DeepSeek-V3 language model's config)")
    return text


def deepseek_fields(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """ModelConfig keyword arguments for a DeepSeek-V3-family config (``raw`` is the whole config.json)."""
    text = text_config(raw, arch, source)

    def need(key: str) -> Any:
        return required_field(text, key, source)

    if text.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act '{text['hidden_act']}' is not supported (silu only)")
    dims = decoder_dims(text, source)
    hidden, heads = dims["hidden_size"], dims["num_heads"]
    q_lora = text.get("q_lora_rank")
    mla = MlaConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(need("kv_lora_rank")),
        qk_nope_head_dim=int(need("qk_nope_head_dim")),
        qk_rope_head_dim=int(need("qk_rope_head_dim")),
        v_head_dim=int(need("v_head_dim")),
        rope_theta=rope_theta(text),
        rope_interleave=bool(text.get("rope_interleave", True)),
        yarn=_yarn(text, source),
        attention_bias=bool(text.get("attention_bias", False)),
    )
    return dict(
        **dims,
        architecture=arch,
        num_layers=int(need("num_hidden_layers")),
        # What a Llama-shaped EAGLE-3 head for this target would use; the target itself reads ``mla``.
        num_kv_heads=heads,
        head_dim=hidden // heads,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        mla=mla,
        moe=_moe(text, source),
        checkpoint_prefix=KIMI_K25_PREFIX if arch == KIMI_K25_ARCHITECTURE else "",
    )


def _yarn(text: dict[str, Any], source: str) -> YarnConfig | None:
    params = rope_params(text)
    kind = rope_type(params)
    if kind == "default":
        return None
    if kind != "yarn":
        raise CheckpointError(f"{source}: rope_type '{kind}' is not supported for DeepSeek-V3 models (default, yarn)")
    orig = int(params.get("original_max_position_embeddings") or 4096)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(text.get("max_position_embeddings", orig)) / orig
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    # transformers' rule for cos/sin (its DeepSeek reference): the ratio when both are given, else mscale(factor).
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        both = mscale and mscale_all_dim
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if both else yarn_mscale(factor)
    return YarnConfig(
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=float(attention_factor),
        mscale_all_dim=float(mscale_all_dim or 0.0),
    )


def _moe(text: dict[str, Any], source: str) -> MoeConfig | None:
    experts = text.get("n_routed_experts")
    if not experts:
        return None  # dense in every layer
    # transformers' DeepseekV3Config writes neither field and always routes this way.
    method, scoring = text.get("topk_method", "noaux_tc"), text.get("scoring_func", "sigmoid")
    if (method, scoring) != ("noaux_tc", "sigmoid"):
        raise CheckpointError(
            f"{source}: MoE routing topk_method={method}, scoring_func={scoring} is not supported (noaux_tc with sigmoid)"
        )
    cfg = MoeConfig(
        n_routed_experts=int(experts),
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 1),
        n_shared_experts=int(text.get("n_shared_experts") or 0),
        moe_intermediate_size=int(text["moe_intermediate_size"]),
        first_k_dense_replace=int(text.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(text.get("moe_layer_freq") or 1),
        n_group=int(text.get("n_group") or 1),
        topk_group=int(text.get("topk_group") or 1),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
    )
    per_group = cfg.n_routed_experts // cfg.n_group
    if cfg.topk_group > cfg.n_group:
        raise CheckpointError(f"{source}: topk_group {cfg.topk_group} exceeds n_group {cfg.n_group} (the groups a token's "
                              "experts are chosen from are among the n_group groups)")
    if cfg.n_routed_experts % cfg.n_group or (cfg.n_group > 1 and per_group < 2):
        raise CheckpointError(
            f"{source}: {cfg.n_routed_experts} experts do not form {cfg.n_group} groups of at least 2 "
            f"(topk_group {cfg.topk_group})"
        )
    if cfg.num_experts_per_tok > per_group * cfg.topk_group:
        raise CheckpointError(
            f"{source}: num_experts_per_tok {cfg.num_experts_per_tok} exceeds the {per_group * cfg.topk_group} experts "
            f"of the {cfg.topk_group} groups kept"
        )
    return cfg
