"""Where a Hugging Face config keeps its rotary settings: transformers >= 5 writes ``rope_parameters``
(theta included), released checkpoints and older versions ``rope_theta`` + ``rope_scaling``. Read once
here for the dense configs and the DeepSeek-V3 family alike."""

from __future__ import annotations

from typing import Any


def rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The rope settings, ``rope_parameters`` over ``rope_scaling``."""
    return {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}


def rope_theta(raw: dict[str, Any]) -> float:
    return float(rope_params(raw).get("rope_theta", raw.get("rope_theta", 10000.0)))


def rope_type(params: dict[str, Any]) -> str:
    """``rope_type`` (or the older ``type``) of :func:`rope_params`' result; "default" when absent."""
    return params.get("rope_type") or params.get("type") or "default"
