"""The DeepSeek benchmark section's limit (bench/sections_deepseek.py): the weight bytes one token reads at
batch 1, counted against transformers' own DeepseekV3ForCausalLM parameters; the section itself needs a GPU."""

from __future__ import annotations

import pytest
from bench_modules import import_bench


@pytest.mark.parametrize("q_lora", [None, 24])
def test_active_weight_bytes_count_what_one_token_reads(q_lora):
    transformers = pytest.importorskip("transformers")
    from deepseek_checkpoints import deepseek_config

    (module,) = import_bench("sections_deepseek")
    cfg = deepseek_config(q_lora_rank=q_lora)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    fields = {k: getattr(cfg, k) for k in module.V2_LITE}
    k = cfg.num_experts_per_tok
    matrices = 0
    router = 0
    for i, layer in enumerate(model.model.layers):
        matrices += sum(p.numel() for p in layer.self_attn.parameters() if p.dim() == 2)
        mlp = layer.mlp
        if i < cfg.first_k_dense_replace:
            matrices += sum(p.numel() for p in mlp.parameters())
        else:
            matrices += k * sum(p.numel() for p in mlp.experts[0].parameters()) if hasattr(mlp.experts, "__getitem__") \
                else k * sum(p[0].numel() for p in mlp.experts.parameters())
            matrices += sum(p.numel() for p in mlp.shared_experts.parameters())
            router += mlp.gate.weight.numel()
    matrices += model.lm_head.weight.numel()
    assert module.active_weight_bytes(fields) == 2 * matrices + 4 * router


def test_the_section_is_registered():
    (section_index,) = import_bench("section_index")
    assert "deepseek" in section_index.SECTIONS
