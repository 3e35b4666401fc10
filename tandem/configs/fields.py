"""The fields every decoder's config.json names alike — the dense families, DeepSeek-V3's text config and
EAGLE-3 heads —, read once here: which are required (missing or null: a one-line CheckpointError naming
the field) and their defaults."""

from __future__ import annotations

from typing import Any

from tandem.errors import CheckpointError


def required_field(raw: dict[str, Any], key: str, source: str) -> Any:
    if raw.get(key) is None:
        raise CheckpointError(f"{source}: missing required field '{key}'")
    return raw[key]


def decoder_dims(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """vocab_size, hidden_size, intermediate_size, num_heads, rms_norm_eps and max_position_embeddings, as
    the config dataclasses name them."""
    def need(key: str) -> int:
        return int(required_field(raw, key, source))

    return dict(vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
                intermediate_size=need("intermediate_size"), num_heads=need("num_attention_heads"),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)))
