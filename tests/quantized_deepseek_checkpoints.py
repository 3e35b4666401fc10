"""Tiny quantized DeepSeek-V3 checkpoints, each with its float32 twin, from a folder transformers'
save_pretrained wrote (deepseek_checkpoints.py).

- ``int4``: the Kimi-K2.5 layout (../shared/reference/deepseek_v3_kimi.md §5): only the routed experts
  INT4, packed by the ``compressed-tensors`` package itself (quantized_checkpoints.int4_compress, bf16
  weights and scales as Kimi ships them); an ignore list of Kimi's kind keeps attention, shared experts,
  dense MLPs, the LM head and vision unquantized.
- ``fp8``: the DeepSeek-V3 layout: every linear but the router and the LM head e4m3 with a float32
  ``weight_scale_inv`` per block, following the published format (quantized_checkpoints.fp8_block_quantize).

The twin holds what those formats dequantize to, as float32 (the reference: a float32 engine run on it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from quantized_checkpoints import fp8_block_quantize, int4_compress, int4_config

ROUTED = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
LINEAR = re.compile(r".*\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)"
                    r"\.weight$")
# Kimi-K2.5's kind of ignore list: everything but the routed experts (re: patterns match prefixed names too)
KIMI_IGNORE = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*",
               "re:vision_tower.*", "re:mm_projector.*")


def write_quantized_deepseek(src: Path, path: Path, twin: Path, method: str, group_size: int = 32,
                             block: tuple[int, int] = (16, 32)) -> dict:
    """``src``: a float32 DeepSeek-V3 folder. Writes ``path`` (quantized) and ``twin`` (float32,
    dequantized); returns the quantized folder's config.json."""
    config = json.loads((src / "config.json").read_text())
    quantized: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if method == "int4" and ROUTED.match(name):
            packed, deq = int4_compress(w.to(torch.bfloat16), group_size)
            quantized.update({f"{module}.{k}": v for k, v in packed.items()})
        elif method == "fp8" and LINEAR.match(name):
            q, scale_inv, deq = fp8_block_quantize(w, block)
            quantized[f"{module}.weight"], quantized[f"{module}.weight_scale_inv"] = q, scale_inv
        else:
            quantized[name], deq = w, w.float()
        dense[name] = deq
    if method == "int4":
        quant = int4_config(group_size, ignore=KIMI_IGNORE)
    else:
        quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    for folder, tensors, cfg in ((path, quantized, {**config, "quantization_config": quant}), (twin, dense, config)):
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return {**config, "quantization_config": quant}
