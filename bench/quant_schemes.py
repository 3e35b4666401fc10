"""The quantization schemes of the quantized benchmark targets (bench/sections_quant_engines.py): the
``quantization_config`` a config-only folder carries (what tandem/configs/quantization.py reads) and the
bytes one ``[rows, cols]`` matrix of the scheme occupies, which is what a decode step reads of it
(the byte counts of bench/models.py and bench/sections_deepseek.py take such a function).

- ``int4``: compressed-tensors pack-quantized, symmetric, group 32: eight int4 to an int32 word plus one
  bf16 scale per 32 columns of a row (0.5625 bytes a weight; compressed-tensors stores a bf16 model's scales in
  bf16, and the engine holds them as stored);
- ``fp8``: DeepSeek-V3's e4m3 with one float32 ``scale_inv`` per 128 x 128 block (≈ 1 byte a weight);
- ``bf16``: two bytes a weight.
"""

from __future__ import annotations

from typing import Callable

MatrixBytes = Callable[[int, int], int]  # (rows, cols) → bytes
INT4_GROUP, FP8_BLOCK = 32, (128, 128)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dense_bytes(dtype_bytes: int = 2) -> MatrixBytes:
    return lambda rows, cols: dtype_bytes * rows * cols


def int4_bytes(group: int = INT4_GROUP, scale_bytes: int = 2) -> MatrixBytes:
    return lambda rows, cols: 4 * rows * cdiv(cols, 8) + scale_bytes * rows * cdiv(cols, group)  # words + scales


def fp8_bytes(block: tuple[int, int] = FP8_BLOCK) -> MatrixBytes:
    return lambda rows, cols: rows * cols + 4 * cdiv(rows, block[0]) * cdiv(cols, block[1])  # e4m3 + scale_inv


def int4_config(group: int = INT4_GROUP, ignore: tuple[str, ...] = ("lm_head",), scale_dtype: str | None = None) -> dict:
    """Every linear but ``ignore`` (compressed-tensors' rules: exact names or ``re:`` patterns) INT4; ``scale_dtype``
    (a torch dtype name) named in the config where given, else the scales take the model's bf16."""
    weights = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group, dynamic=False)
    if scale_dtype:
        weights["scale_dtype"] = f"torch.{scale_dtype}"
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": list(ignore)}


# Kimi-K2.5's kind of list: only the routed experts INT4; attention, shared experts, dense MLPs, LM head bf16
ROUTED_ONLY = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*")


def fp8_config(block: tuple[int, int] = FP8_BLOCK) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
