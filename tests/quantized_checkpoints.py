"""Tiny quantized Llama checkpoints for the quantization tests, each with its float32 twin.

INT4 is packed by the ``compressed-tensors`` package itself (its group quantizer, its packer, its
config), and the twin's weights are what its own decompressor returns — none of tandem's code. FP8
block-wise follows the published DeepSeek-V3 format: e4m3 ``weight`` and a float32 ``weight_scale_inv``
per block (amax / 448), edge blocks covering what is left; the twin multiplies them out block by block.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.models.random_checkpoint import LlamaShape, hf_config, random_llama_state

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS


def int4_scheme(group_size: int = 32):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


def int4_config(group_size: int = 32, ignore: tuple[str, ...] = ("lm_head",)) -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    cfg = QuantizationConfig(config_groups={"group_0": int4_scheme(group_size)}, format="pack-quantized",
                             ignore=list(ignore), quantization_status="compressed")
    return cfg.model_dump()


def int4_compress(weight: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' group quantization and packing of one weight → (its tensors, its float32
    dequantization by compressed-tensors' decompressor)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = int4_scheme(group_size)
    grouped = weight.reshape(weight.shape[0], -1, group_size)
    scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), scheme.weights)
    packed = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    back = PackedQuantizationCompressor.decompress({**packed, "weight_scale": packed["weight_scale"].float()}, scheme)
    return packed, back["weight"].float()


def fp8_block_quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ (e4m3 weight, float32 scale_inv [ceil(N/bn), ceil(K/bk)], float32 dequantized weight)."""
    n, k = weight.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:n, :k] = weight.float()
    blocks = padded.view(nb, bn, kb, bk)
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [nb, kb]
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = (q.float() * scale_inv[:, None, :, None]).view(nb * bn, kb * bk)[:n, :k]
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale_inv, deq.contiguous()


def write_quantized_llama(path: Path, twin: Path, shape: LlamaShape, method: str, seed: int = 0,
                          group_size: int = 32, block: tuple[int, int] = (32, 64)) -> dict:
    """Write ``path`` (INT4 or FP8 quantized, bf16 otherwise) and ``twin`` (float32, the dequantized
    weights); returns the quantized config.json."""
    state = random_llama_state(shape, torch.bfloat16, seed=seed, std=0.08)
    quantized: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if not is_linear(name):
            quantized[name], dense[name] = w, w.float()
            continue
        module = name.removesuffix(".weight")
        if method == "int4":
            packed, deq = int4_compress(w, group_size)
            quantized.update({f"{module}.{k}": v for k, v in packed.items()})
        else:
            q, scale_inv, deq = fp8_block_quantize(w, block)
            quantized[f"{module}.weight"], quantized[f"{module}.weight_scale_inv"] = q, scale_inv
        dense[name] = deq
    cfg = hf_config(shape, "bfloat16")
    if method == "int4":
        cfg["quantization_config"] = int4_config(group_size)
    else:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)}
    for folder, tensors, config in ((path, quantized, cfg), (twin, dense, hf_config(shape, "float32"))):
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return cfg
