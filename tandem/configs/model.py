"""ModelConfig: the frozen, validated view of a Hugging Face ``config.json`` that model code reads.

Model code never touches the raw HF dictionary; everything it needs is a field here, read once.
This module is torch-free so the gateway and config validation can use it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tandem.errors import CheckpointError, ConfigError
from tandem.configs.fields import decoder_dims, required_field
from tandem.configs.quantization import Int4Group, QuantConfig, parse_quantization, with_scale_dtype
from tandem.configs.stored_dtypes import stored_float_dtype
from tandem.configs.rope_fields import rope_params, rope_theta, rope_type
from tandem.configs.deepseek import DEEPSEEK_ARCHITECTURES, MlaConfig, MoeConfig, deepseek_fields, text_config

# architecture name -> (qkv projections carry a bias, q/k RMSNorm per head)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class AttentionWidths:
    """q and k/v projection widths of a config with ``num_heads``, ``num_kv_heads`` and ``head_dim``."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class ModelConfig(AttentionWidths):
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    o_bias: bool  # Llama's attention_bias also puts a bias on o_proj
    mlp_bias: bool  # Llama's mlp_bias: gate/up/down carry biases
    dtype: str  # checkpoint dtype name: "bfloat16", "float16" or "float32"
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None
    # quantization_config (tandem.configs.quantization): None for a float checkpoint
    quantization: QuantConfig | None = None
    # DeepSeek-V3 family (tandem.configs.deepseek): latent attention, routed experts, and the
    # prefix of the text model's tensors in a multimodal wrapper (Kimi-K2.5: "language_model.")
    mla: MlaConfig | None = None
    moe: MoeConfig | None = None
    checkpoint_prefix: str = ""

    def default_capture_layers(self) -> tuple[int, ...]:
        """EAGLE-3's default: residual-stream inputs of layers 2, N//2 and N-3 (docs/architecture.md, "Contracts").

        Always three entries (the draft head expects 3·H features); on toy models with fewer than
        six layers they are clamped into range and may repeat."""
        n = self.num_layers
        return tuple(sorted((min(2, n - 1), n // 2, max(n - 3, 0))))

    def check_tensor_parallel(self, tp: int) -> None:
        """ConfigError naming the first of this model's dimensions that ``tp`` ranks cannot split (the layers' own
        checks name only a width, and only once the ranks are up)."""
        # (a count reads before its noun, a size after: "4 attention heads", "MLP intermediate size 160")
        splits = [(f"{self.num_heads} attention heads", self.num_heads),
                  (f"MLP intermediate size {self.intermediate_size}", self.intermediate_size)]
        if self.mla is None and self.num_kv_heads >= tp:  # (fewer KV heads than ranks are replicated)
            splits.append((f"{self.num_kv_heads} key/value heads", self.num_kv_heads))
        if self.moe is not None:
            splits.append((f"experts' intermediate size {self.moe.moe_intermediate_size}", self.moe.moe_intermediate_size))
        for what, n in splits:
            if n % tp:
                sizes = [d for d in range(1, 9) if all(m % d == 0 for _, m in splits)]  # (up to one node's 8)
                raise ConfigError(f"--tp-size {tp}: the model's {what} cannot be split {tp} ways (sizes that "
                                  f"can: {', '.join(map(str, sizes))})")
        if self.mla is None and self.num_kv_heads < tp and tp % self.num_kv_heads:
            raise ConfigError(f"--tp-size {tp}: the model's {self.num_kv_heads} key/value heads cannot be shared "
                              f"evenly by {tp} ranks")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path, raw = read_config_json(model_dir, "a Hugging Face model folder")
        generation = Path(model_dir) / "generation_config.json"
        gen_raw = json.loads(generation.read_text()) if generation.is_file() else {}
        cfg = cls.from_hf_dict(raw, source=str(path), generation_config=gen_raw,
                               tokenizer_eos=tokenizer_eos_id(model_dir))
        if cfg.quantization is None or not isinstance(cfg.quantization.scheme, Int4Group):
            return cfg
        stored = stored_float_dtype(model_dir, ".weight_scale")  # INT4 scales are held as the checkpoint stores them
        return replace(cfg, quantization=with_scale_dtype(cfg.quantization, stored)) if stored else cfg

    @classmethod
    def from_hf_dict(
        cls, raw: dict[str, Any], source: str = "config.json", generation_config: dict | None = None,
        tokenizer_eos: int | None = None,
    ) -> "ModelConfig":
        """``generation_config``: generation_config.json's fields; ``tokenizer_eos``: the tokenizer's EOS id. A
        request stops at generation_config's EOS ids (config.json's where it names none, as transformers derives a
        generation config) and at the tokenizer's, as vLLM stops (a chat model's end of turn is often only one of
        them)."""
        archs = raw.get("architectures") or []
        quant = parse_quantization(raw, source)
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES or a in DEEPSEEK_ARCHITECTURES), None)
        if arch is None:
            named = ", ".join(archs) if archs else "none given"
            supported = ", ".join([*SUPPORTED_ARCHITECTURES, *DEEPSEEK_ARCHITECTURES])
            raise CheckpointError(f"{source}: unsupported architecture ({named}); supported: {supported}")
        gen = generation_config or {}
        if arch in DEEPSEEK_ARCHITECTURES:
            text = text_config(raw, arch, source)
            eos = _eos_ids(_first(gen.get("eos_token_id"), raw.get("eos_token_id", text.get("eos_token_id"))),
                           tokenizer_eos)
            fields = deepseek_fields(raw, arch, source)
            # ``rope``: what a Llama-shaped EAGLE-3 head for this target would use; the target reads ``mla``.
            return cls(**fields, rope=RopeConfig(theta=fields["mla"].rope_theta),
                       qkv_bias=False, qk_norm=False, o_bias=False, mlp_bias=False, dtype=_dtype_name(text, raw),
                       eos_token_ids=eos, bos_token_id=raw.get("bos_token_id", text.get("bos_token_id")),
                       quantization=with_scale_dtype(quant, _dtype_name(text, raw), unless_named=True))
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        # Llama and Qwen3 read attention_bias for q/k/v and o_proj; Qwen2 always biases q/k/v only.
        o_bias = arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias"))
        mlp_bias = arch == "LlamaForCausalLM" and bool(raw.get("mlp_bias"))
        if o_bias:
            qkv_bias = True
        if raw.get("use_sliding_window"):
            raise CheckpointError(f"{source}: use_sliding_window=true is not supported (full attention only)")

        dims = decoder_dims(raw, source)
        hidden, heads = dims["hidden_size"], dims["num_heads"]
        eos = _eos_ids(_first(gen.get("eos_token_id"), raw.get("eos_token_id")), tokenizer_eos)
        dtype = _dtype_name(raw)
        return cls(
            **dims,
            architecture=arch,
            num_layers=int(required_field(raw, "num_hidden_layers", source)),
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope=_rope_from_hf(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            dtype=dtype,
            eos_token_ids=eos,
            bos_token_id=raw.get("bos_token_id"),
            quantization=with_scale_dtype(quant, dtype, unless_named=True),
        )


def _first(*values: Any) -> Any:
    """The first of ``values`` that is not None."""
    return next((v for v in values if v is not None), None)


def _eos_ids(*named: Any) -> tuple[int, ...]:
    """The EOS ids ``named`` (each an id, a list of ids or None), in order, each once."""
    ids = [int(e) for eos in named for e in (eos if isinstance(eos, list) else [] if eos is None else [eos])]
    return tuple(dict.fromkeys(ids))


def tokenizer_eos_id(model_dir: str | Path) -> int | None:
    """The id of tokenizer_config.json's ``eos_token`` where the folder says it without loading a tokenizer: in
    tokenizer_config.json's ``added_tokens_decoder`` (Kimi's tiktoken folders too), tokenizer.json's ``added_tokens``
    or its model's vocabulary (BPE / WordPiece: token → id; Unigram: a list of [token, score]); None otherwise."""
    folder = Path(model_dir)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    decoder = config.get("added_tokens_decoder") or {}
    found = [int(i) for i, t in decoder.items() if isinstance(t, dict) and t.get("content") == eos and i.isdigit()]
    if found:
        return found[0]
    try:
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(tokenizer, dict):
        return None
    added = tokenizer.get("added_tokens") or []
    found = [t["id"] for t in added if isinstance(t, dict) and t.get("content") == eos and isinstance(t.get("id"), int)]
    if found:
        return found[0]
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        found = [vocab[eos]] if isinstance(vocab.get(eos), int) else []
    elif isinstance(vocab, list):
        found = [i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry and entry[0] == eos]
    return found[0] if found else None


def _dtype_name(*raws: dict[str, Any]) -> str:
    named = next((r.get("torch_dtype") or r.get("dtype") for r in raws if r.get("torch_dtype") or r.get("dtype")), None)
    return str(named or "float32").replace("torch.", "")


def read_config_json(folder: str | Path, kind: str) -> tuple[Path, dict[str, Any]]:
    """``folder/config.json`` parsed, or a one-line CheckpointError saying what is wrong."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json (is this {kind}?)")
    try:
        return path, json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _rope_from_hf(raw: dict[str, Any], source: str) -> RopeConfig:
    merged = rope_params(raw)
    kind = rope_type(merged)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: unsupported rope_type '{kind}'; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=rope_theta(raw),
        rope_type=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )
