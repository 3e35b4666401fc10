"""Quantized DeepSeek-V3 / Kimi checkpoints (tiny, written by transformers then quantized): INT4 routed
experts packed by compressed-tensors (Kimi-K2.5's layout) and FP8 block-wise everywhere (DeepSeek-V3's);
logits of the plain and absorbed MLA forms and greedy output equal a float32 engine on the dequantized
twin; weights held packed (kv_b_proj also dequantized once for the absorbed form); the Kimi-K2.5
wrapper reads its text_config's quantization_config; a quantized router is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepseek_checkpoints import write_deepseek, write_kimi_k25
from helpers import assert_rel, forward_fresh, manual_greedy_logits, random_prompt, rel_err
from quantized_deepseek_checkpoints import write_quantized_deepseek
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.errors import CheckpointError
from tandem.configs.model import ModelConfig
from tandem.sampling import SamplingParams

VOCAB = 512
LAYERS = dict(num_hidden_layers=4)  # layer 0 dense (first_k_dense_replace 1), 1..3 MoE
PROMPTS = [random_prompt(80, 37, VOCAB), random_prompt(81, 6, VOCAB)]
MAX_NEW = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-deepseek")
    write_deepseek(root / "src", seed=31, **LAYERS)
    for method in ("int4", "fp8"):
        write_quantized_deepseek(root / "src", root / method, root / f"{method}-twin", method)
    write_kimi_k25(root / "int4", root / "kimi")
    return root


def run(model_dir: Path) -> dict:
    with LLMEngine(EngineConfig(model=str(model_dir), page_size=8)) as eng:
        prompt_logits, _ = forward_fresh(eng, PROMPTS)  # the plain MLA form
        _, decode_logits = manual_greedy_logits(eng, PROMPTS[0], 8)  # the absorbed form, over the latent cache
        greedy = eng.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
        return dict(prompt=prompt_logits, decode=decode_logits, greedy=[r.output_token_ids for r in greedy],
                    model=eng.executor.runner.model)


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_logits_and_greedy_equal_the_dequantized_float32_twin(folders, method):
    ours, twin = run(folders / method), run(folders / f"{method}-twin")
    for form in ("prompt", "decode"):
        print(f"{method} {form} logits: relative error {rel_err(ours[form], twin[form]):.3g}")
        assert_rel(ours[form], twin[form], 1e-4, f"{form} logits")
    with LLMEngine(EngineConfig(model=str(folders / "src"))) as unquantized:  # the twin is not the float model
        assert rel_err(twin["prompt"][:1], unquantized.prompt_logits(PROMPTS[0])[:1]) > 1e-3
    assert ours["greedy"] == twin["greedy"]
    assert len({t for out in twin["greedy"] for t in out}) > 5  # not a degenerate model

    layer = ours["model"].model.layers[1]
    expert, attn = layer.mlp.experts[0], layer.self_attn
    if method == "int4":  # routed experts packed, everything else float
        assert expert.gate_up_proj.weight_packed.dtype == torch.int32 and not hasattr(expert.down_proj, "weight")
        assert attn.kv_b_proj.quant is None and layer.mlp.shared_experts.down_proj.quant is None
        assert ours["model"].model.layers[0].mlp.gate_up_proj.quant is None
    else:  # every linear fp8, kv_b_proj also dense (dequantized once, at load) for the absorbed form
        for proj in (attn.fused_qkv_a_proj_with_mqa, attn.q_b_proj, attn.kv_b_proj, attn.o_proj,
                     expert.gate_up_proj, layer.mlp.shared_experts.down_proj,
                     ours["model"].model.layers[0].mlp.down_proj):
            assert proj.weight.dtype == torch.float8_e4m3fn and proj.weight_scale_inv.dtype == torch.float32
        assert attn._kv_b_dense.dtype == torch.float32
        assert torch.equal(attn._kv_b_dense, twin["model"].model.layers[1].self_attn.kv_b_proj.weight)
    assert layer.mlp.gate.weight.dtype == torch.float32 and ours["model"].lm_head.weight.dtype == torch.float32


def test_kimi_k25_folder_reads_text_configs_quantization(folders):
    raw = json.loads((folders / "kimi" / "config.json").read_text())
    assert "quantization_config" not in raw and raw["text_config"]["quantization_config"]["format"] == "pack-quantized"
    cfg = ModelConfig.from_dir(folders / "kimi")
    q, p = cfg.quantization, "language_model.model.layers.1."
    assert q.scheme_for([p + "mlp.experts.3.down_proj"]).group_size == 32
    for unquantized in ("self_attn.kv_b_proj", "mlp.shared_experts.gate_proj", "mlp.gate_proj"):
        assert q.scheme_for([p + unquantized]) is None, unquantized
    prompt = PROMPTS[0]
    with LLMEngine(EngineConfig(model=str(folders / "kimi"))) as kimi, \
            LLMEngine(EngineConfig(model=str(folders / "int4-twin"))) as twin:
        assert_rel(kimi.prompt_logits(prompt), twin.prompt_logits(prompt), 1e-4, "Kimi-K2.5 wrapper")


def test_a_quantized_router_is_refused_in_one_line(folders):
    from tandem.models.registry import build_model

    raw = json.loads((folders / "int4" / "config.json").read_text())
    raw["quantization_config"]["config_groups"]["group_0"]["targets"] = [r"re:.*mlp\.experts\..*", r"re:.*mlp\.gate$"]
    with pytest.raises(CheckpointError) as e:
        build_model(ModelConfig.from_hf_dict(raw))
    msg = str(e.value)
    assert "\n" not in msg and "quantizes the MoE router model.layers.1.mlp.gate, which is not supported" in msg, msg
