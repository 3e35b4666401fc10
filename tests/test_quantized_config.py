"""quantization_config parsing: where it is found, which linears each scheme covers (compressed-tensors'
own config and Kimi-K2-Thinking's ignore list), and every unsupported scheme refused at start-up with
one line naming it."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from quantized_checkpoints import int4_config
from tandem.errors import CheckpointError
from tandem.configs.model import ModelConfig
from tandem.configs.quantization import Fp8Block, Int4Group, parse_quantization
from tandem.models.random_checkpoint import LlamaShape, hf_config

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
BF16_INT4 = Int4Group(32, "bfloat16")  # llama_with's model dtype: its scales' without a checkpoint to say
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def llama_with(quant: dict | None, wrapped: bool = False) -> dict:
    raw = hf_config(LlamaShape(), "bfloat16")
    if wrapped:  # Kimi-K2.5: the text model's config, quantization included, inside text_config
        return {"architectures": ["LlamaForCausalLM"], **raw, "text_config": {"quantization_config": quant}}
    return {**raw, "quantization_config": quant}


def test_fp8_block_config():
    q = ModelConfig.from_hf_dict(llama_with(FP8)).quantization
    assert q.scheme == Fp8Block((128, 128))
    assert q.scheme_for(["model.layers.0.self_attn.q_proj"]) == Fp8Block((128, 128))
    assert q.scheme_for(["lm_head"]) is None  # HF's fp8 never converts the LM head
    skipping = parse_quantization({"quantization_config": {**FP8, "modules_to_not_convert": ["model.layers.1.mlp"]}})
    assert skipping.scheme_for(["model.layers.1.mlp.down_proj"]) is None
    assert skipping.scheme_for(["model.layers.11.mlp.down_proj"]) is not None


def test_compressed_tensors_config_written_by_the_package():
    q = ModelConfig.from_hf_dict(llama_with(int4_config(32))).quantization
    assert q.scheme == BF16_INT4 and q.method == "compressed-tensors"
    assert q.scheme_for(["model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj"]) == BF16_INT4
    assert ModelConfig.from_hf_dict(llama_with(None)).quantization is None


def test_int4_scales_are_held_as_the_checkpoint_stores_them(tmp_path):
    """Without tensors the scales take the model's dtype (compressed-tensors writes a bf16 model's scales in bf16);
    a folder's stored dtype wins, read from its safetensors header (single file or sharded with an index); an FP8
    scheme is left as it is."""
    from safetensors.torch import save_file

    raw = llama_with(int4_config(32))
    assert ModelConfig.from_hf_dict({**raw, "torch_dtype": "float32"}).quantization.scheme.scale_dtype == "float32"
    named = copy.deepcopy(raw)  # the config's own scale_dtype (compressed-tensors' QuantizationArgs field) comes next
    named["quantization_config"]["config_groups"]["group_0"]["weights"]["scale_dtype"] = "torch.float16"
    assert ModelConfig.from_hf_dict(named).quantization.scheme.scale_dtype == "float16"
    named["quantization_config"]["config_groups"]["group_0"]["weights"]["scale_dtype"] = "torch.float8_e4m3fn"
    with pytest.raises(CheckpointError, match="scale_dtype 'torch.float8_e4m3fn' in group 'group_0' is not supported"):
        ModelConfig.from_hf_dict(named)
    assert ModelConfig.from_hf_dict(llama_with(FP8)).quantization.scheme == Fp8Block((128, 128))
    described = ModelConfig.from_hf_dict(raw).quantization.describe()
    assert described == "int4 group 32, bfloat16 scales on every linear but 1 ignored"
    for stored, sharded in ((torch.float32, False), (torch.float16, True), (torch.bfloat16, False)):
        folder = tmp_path / f"{stored}-{sharded}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(raw))
        tensors = {"model.embed_tokens.weight": torch.zeros(4, 4),
                   "model.layers.0.mlp.down_proj.weight_scale": torch.ones(4, 1, dtype=stored)}
        if sharded:
            save_file({"model.embed_tokens.weight": tensors.pop("model.embed_tokens.weight")}, str(folder / "a.safetensors"))
            (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
                "model.embed_tokens.weight": "a.safetensors", "model.layers.0.mlp.down_proj.weight_scale": "b.safetensors"}}))
        save_file(tensors, str(folder / ("b.safetensors" if sharded else "model.safetensors")))
        assert ModelConfig.from_dir(folder).quantization.scheme == Int4Group(32, str(stored).removeprefix("torch."))


def test_kimi_ignore_list_in_text_config_quantizes_only_routed_experts():
    quant = int4_config(32, ignore=tuple(KIMI_IGNORE))
    q = ModelConfig.from_hf_dict(llama_with(quant, wrapped=True)).quantization
    p = "language_model.model.layers.5."
    assert q.scheme_for([p + "mlp.experts.17.gate_proj", p + "mlp.experts.17.up_proj"]) == BF16_INT4
    for dense in ("self_attn.q_a_proj", "self_attn.kv_b_proj", "mlp.shared_experts.down_proj", "mlp.gate_proj"):
        assert q.scheme_for([p + dense]) is None, dense


@pytest.mark.parametrize("ignored, accepted", [(("lm_head",), True), (("language_model.lm_head",), True),
                                               (("re:.*lm_head",), True), (("language_model.model.norm",), False)])
def test_a_wrappers_lm_head_may_be_ignored_by_its_checkpoint_name(ignored, accepted):
    """Kimi-K2.5's LM head is ``language_model.lm_head`` in its checkpoint: ignored under that name it is not refused as
    quantized (it was: only the bare ``lm_head`` counted)."""
    raw = llama_with(int4_config(32, ignore=ignored), wrapped=True)
    if accepted:
        assert ModelConfig.from_hf_dict(raw).quantization.scheme == BF16_INT4
    else:
        with pytest.raises(CheckpointError, match="a quantized lm_head"):
            ModelConfig.from_hf_dict(raw)


def test_a_dense_sparsity_config_is_no_sparsity():
    """compressed-tensors' own "dense" sparsity config (some llm-compressor versions write it beside W4A16) is taken
    as none; a real sparsity format is refused."""
    from compressed_tensors.config import SparsityCompressionConfig

    for fmt, accepted in (("dense", True), ("sparse-bitmask", False)):
        quant = _with(int4_config(32), sparsity_config=SparsityCompressionConfig.load_from_registry(fmt).model_dump())
        if accepted:
            assert ModelConfig.from_hf_dict(llama_with(quant)).quantization.scheme == BF16_INT4
        else:
            with pytest.raises(CheckpointError, match="sparsity_config is not supported"):
                ModelConfig.from_hf_dict(llama_with(quant))


def test_fused_parts_quantized_differently_are_refused():
    q = parse_quantization({"quantization_config": int4_config(32, ignore=("lm_head", "re:.*k_proj"))})
    with pytest.raises(CheckpointError, match="fused into one matmul must be quantized alike"):
        q.scheme_for(["a.q_proj", "a.k_proj", "a.v_proj"])


def _ct(**weights) -> dict:
    cfg = int4_config(32)
    cfg["config_groups"]["group_0"]["weights"].update(weights)
    return cfg


def _with(cfg: dict, **top) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg.update(top)
    return cfg


ACTS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
REFUSED = {
    "awq": ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    "gptq": ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    "fp8-per-tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8 without weight_block_size"),
    "fp8-static": ({**FP8, "activation_scheme": "static"}, "activation_scheme 'static'"),
    "fp8-e5m2": ({**FP8, "fmt": "e5m2"}, "fp8 fmt 'e5m2'"),
    "fp8-block-3d": ({**FP8, "weight_block_size": [128, 128, 1]}, "weight_block_size [128, 128, 1]"),
    "int8": (_ct(num_bits=8), "8-bit weights"),
    "asymmetric": (_ct(symmetric=False), "asymmetric weights"),
    "channel": (_ct(strategy="channel", group_size=None), "weight strategy 'channel'"),
    "dynamic": (_ct(dynamic=True), "dynamic weight quantization"),
    "fp4": (_ct(type="float"), "weight type 'float'"),
    "actorder": (_ct(actorder="group"), "actorder 'group'"),
    "group-12": (_ct(group_size=12), "group_size 12"),
    "w4a8": (_with(int4_config(32), config_groups={"group_0": {**int4_config(32)["config_groups"]["group_0"],
                                                               "input_activations": ACTS}}),
             "activation quantization (input_activations"),
    "float-quantized": (_with(int4_config(32), format="float-quantized"), "format 'float-quantized'"),
    "naive": (_with(int4_config(32), format="naive-quantized"), "format 'naive-quantized'"),
    "kv-cache": (_with(int4_config(32), kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    "frozen": (_with(int4_config(32), quantization_status="frozen"), "quantization_status 'frozen'"),
    "lm-head": (int4_config(32, ignore=()), "a quantized lm_head"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_schemes_are_refused_in_one_line(case):
    quant, what = REFUSED[case]
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_hf_dict(llama_with(quant), source="m/config.json")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("m/config.json: quantization_config: ") and what in msg, msg
    assert "is not supported" in msg


def test_a_quantized_deepseek_checkpoint_builds_with_packed_layers():
    """Its layers take the formats (tests/test_quantized_deepseek.py serves them); only a quantized router is refused."""
    from deepseek_checkpoints import deepseek_config
    from tandem.models.registry import build_model

    raw = {**deepseek_config().to_dict(), "architectures": ["DeepseekV3ForCausalLM"],
           "quantization_config": {**FP8, "weight_block_size": [16, 32]}}
    model = build_model(ModelConfig.from_hf_dict(raw))
    assert model.model.layers[1].mlp.experts[0].down_proj.weight.dtype == torch.float8_e4m3fn
