"""Which model class serves a ModelConfig. Every class offers the same surface to the engine:
``forward``/``logits`` (tandem.models.llama.CausalLM's), ``kv_spec()``, ``load(model_dir)`` and
``supports_cuda_graphs``."""

from __future__ import annotations

from torch import nn

from tandem.errors import CheckpointError
from tandem.models.config import ModelConfig


def build_model(cfg: ModelConfig) -> nn.Module:
    if cfg.mla is not None:
        if cfg.quantization is not None:  # its linears and experts take no quant format yet (issue 21)
            raise CheckpointError(f"{cfg.architecture}: quantized checkpoints ({cfg.quantization.method}) are not "
                                  "supported for this architecture yet; only Llama/Qwen dense linears")
        from tandem.models.deepseek_v3 import DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM(cfg)
    from tandem.models.llama import CausalLM

    return CausalLM(cfg)
