"""Random benchmark weights (``load_format="random"``, tandem/models/random_weights.py) for quantized
targets: a tiny INT4 / FP8 Llama and a tiny DeepSeek-V3 with INT4 routed experts (Kimi-K2.5's layout) start
on the CPU and run a forward; every quantized layer's dequantized weight has the bf16 matrices' std
(within 20 %), positive scales, and ``weight_shape`` as a load from a real checkpoint leaves it."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import forward_fresh, random_prompt
from quantized_checkpoints import int4_config, write_quantized_llama
from quantized_deepseek_checkpoints import KIMI_IGNORE
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.layers.quantized_linear import Int4GroupFormat, QuantFormat
from tandem.models.random_checkpoint import LlamaShape, hf_config

SHAPE = LlamaShape(vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2)
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 64]}
STD = 0.02  # randomize_weights' default, what the runner draws with


def _folder(path, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _check_random_engine(path) -> tuple[int, object]:
    """Start ``path`` with random weights, run a forward, check every quantized layer; → (layers checked, model)."""
    with LLMEngine(EngineConfig(model=str(path), device="cpu", load_format="random")) as eng:
        logits, _ = forward_fresh(eng, [random_prompt(1, 7, 256)])
        assert torch.isfinite(logits).all()
        model, checked = eng.executor.runner.model, 0
        for name, layer in model.named_modules():
            fmt = getattr(layer, "quant", None)
            if not isinstance(fmt, QuantFormat):
                continue
            w = fmt.dequantize(layer, torch.float32)
            assert abs(w.std().item() / STD - 1) < 0.2, name
            scales = [getattr(layer, n) for n in fmt.tensors if n.startswith("weight_scale")]
            assert scales and all((s > 0).all() for s in scales), name
            if isinstance(fmt, Int4GroupFormat):
                assert layer.weight_shape.tolist() == [0, 0], name  # as a checkpoint load leaves it (below)
            checked += 1
        return checked, model


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_a_random_quantized_llama_runs_with_weights_of_the_intended_size(tmp_path, method):
    quant = int4_config(32) if method == "int4" else FP8
    checked, _ = _check_random_engine(_folder(tmp_path / method, {**hf_config(SHAPE, "bfloat16"),
                                                                 "quantization_config": quant}))
    assert checked == 4 * SHAPE.num_layers  # qkv, o, gate_up, down


def test_weight_shape_is_what_a_checkpoint_load_leaves(tmp_path):
    write_quantized_llama(tmp_path / "q", tmp_path / "twin", SHAPE, "int4")
    with LLMEngine(EngineConfig(model=str(tmp_path / "q"), device="cpu")) as eng:
        loaded = {n: p for n, p in eng.executor.runner.model.named_parameters() if n.endswith("weight_shape")}
    assert loaded and all(p.tolist() == [0, 0] for p in loaded.values())


def test_a_random_deepseek_with_int4_routed_experts_runs(tmp_path):
    pytest.importorskip("transformers")
    from deepseek_checkpoints import deepseek_config

    config = deepseek_config(vocab_size=256, num_hidden_layers=3).to_dict()
    config.update(architectures=["DeepseekV3ForCausalLM"], torch_dtype="bfloat16",
                  quantization_config=int4_config(32, ignore=KIMI_IGNORE))
    checked, model = _check_random_engine(_folder(tmp_path / "ds", config))
    layers, experts = config["num_hidden_layers"], config["n_routed_experts"]
    assert checked == (layers - config["first_k_dense_replace"]) * experts * 2  # only the routed experts
    moe = model.model.layers[layers - 1].mlp
    assert moe.gate.weight.std().item() == pytest.approx(STD, rel=0.2)  # the float32 router as before
