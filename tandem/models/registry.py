"""Which model class serves a ModelConfig. Every class offers the same surface to the engine:
``forward``/``logits`` (tandem.models.llama.CausalLM's), ``kv_spec()``, ``load(model_dir)`` and
``supports_cuda_graphs``."""

from __future__ import annotations

from torch import nn

from tandem.errors import CheckpointError
from tandem.configs.model import ModelConfig


def build_model(cfg: ModelConfig) -> nn.Module:
    if cfg.mla is not None:
        _refuse_quantized_router(cfg)
        from tandem.models.deepseek_v3 import DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM(cfg)
    from tandem.models.llama import CausalLM

    return CausalLM(cfg)


def _refuse_quantized_router(cfg: ModelConfig) -> None:
    """The MoE router stays float32 (its scores choose experts). ``Linear`` targets never reach it (it is no
    nn.Linear in the reference code, so compressed-tensors leaves it alone and fp8 has no scale for it), but a
    compressed-tensors group naming it explicitly would; refused at start-up rather than at its tensors."""
    q = cfg.quantization
    if q is None or q.method != "compressed-tensors" or "Linear" in q.targets or cfg.moe is None:
        return
    for i in range(cfg.num_layers):
        name = f"{cfg.checkpoint_prefix}model.layers.{i}.mlp.gate"
        if cfg.moe.is_moe_layer(i) and q.scheme_for([name]) is not None:
            raise CheckpointError(f"{cfg.architecture}: quantization_config quantizes the MoE router {name}, "
                                  "which is not supported (add it to the ignore list; routers stay unquantized)")
