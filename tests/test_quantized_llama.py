"""Quantized Llama checkpoints (INT4 packed by compressed-tensors, FP8 block-wise) served by the engine:
logits and EAGLE-3 features equal a float32 engine on the dequantized twin, greedy output identical,
weights held packed, shards along whole groups/blocks (one rank's slice of a TP layer is the slice of
the dequantized weight; a tp size that would split a block refused), TP 2 equal to TP 1, and a random
EAGLE-3 head speculating on an INT4 target with greedy output identical to target-only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import assert_rel, forward_fresh, random_prompt
from quantized_checkpoints import write_quantized_llama
from tandem import distributed
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.errors import CheckpointError, ConfigError
from tandem.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.layers.quantized_linear import linear_format
from tandem.configs.model import ModelConfig
from tandem.models.llama import CausalLM
from tandem.models.random_checkpoint import LlamaShape
from tandem.sampling import SamplingParams

SHAPE = LlamaShape(vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2)
# 352 = 5 x 64 + 32: down_proj's columns end in a partial FP8 block (fine whole, split at TP 2)
RAGGED = LlamaShape(vocab_size=256, hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4, num_kv_heads=2)
PROMPTS = [random_prompt(70, 9, 256), random_prompt(71, 23, 256), random_prompt(72, 3, 256)]
MAX_NEW = 20
CASES = {"int4": (SHAPE, "int4"), "fp8": (SHAPE, "fp8"), "fp8-ragged": (RAGGED, "fp8")}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    for name, (shape, method) in CASES.items():
        write_quantized_llama(root / name, root / f"{name}-twin", shape, method, seed=3)
    return {name: (root / name, root / f"{name}-twin") for name in CASES}


def run(model_dir: Path, **kw) -> dict:
    with LLMEngine(EngineConfig(model=str(model_dir), **kw)) as eng:
        logits, features = forward_fresh(eng, PROMPTS, capture_features=True)
        greedy = eng.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
        return dict(logits=logits, features=features, greedy=[r.output_token_ids for r in greedy],
                    model=eng.executor.runner.model)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_features_and_greedy_equal_the_dequantized_float32_twin(ckpts, case):
    quantized, twin = (run(p) for p in ckpts[case])
    assert_rel(quantized["logits"], twin["logits"], 1e-4, "logits")
    assert_rel(quantized["features"], twin["features"], 1e-4, "EAGLE-3 features")
    assert quantized["greedy"] == twin["greedy"]
    assert len({t for out in twin["greedy"] for t in out}) > 5  # not a degenerate model


@pytest.mark.parametrize("case", ["int4", "fp8"])
def test_weights_stay_packed(ckpts, case):
    model = run(ckpts[case][0])["model"]
    layer = model.model.layers[0]
    stored = load_file(str(ckpts[case][0] / "model.safetensors"))
    scales = {"int4": "weight_scale", "fp8": "weight_scale_inv"}[case]  # held as stored (INT4: compressed-tensors'
    scale_dtype = stored[f"model.layers.0.mlp.down_proj.{scales}"].dtype  # bf16, the model's; FP8: float32)
    want = {"int4": {"weight_packed": torch.int32, "weight_scale": scale_dtype},
            "fp8": {"weight": torch.float8_e4m3fn, "weight_scale_inv": scale_dtype}}[case]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert {n: p.dtype for n, p in proj.named_parameters() if n in want} == want
        if case == "int4":
            assert not hasattr(proj, "weight")
    # the packed weights: 1/8 (int4) or 1/4 (fp8) of float32's bytes, plus the scales
    packed = sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if "norm" not in n)
    dense = 4 * SHAPE.hidden_size * (2 * SHAPE.hidden_size + 2 * 64 + 3 * SHAPE.intermediate_size)
    assert packed < dense * {"int4": 0.2, "fp8": 0.3}[case]
    assert model.lm_head.weight.dtype == torch.float32  # unquantized, as the format says


def _set_rank(monkeypatch, rank: int, size: int) -> None:
    monkeypatch.setattr(distributed, "_GROUP", distributed.TPGroup(rank=rank, size=size))


@pytest.mark.parametrize("case", ["int4", "fp8"])
def test_tp_shards_are_slices_of_the_dequantized_weight(ckpts, case, monkeypatch):
    """Each rank of TP 2 loads whole groups/blocks; its dequantized weight is its slice of the twin's
    (q/k/v and gate/up fused, o/down split by input columns)."""
    quantized, twin = ckpts[case]
    cfg = ModelConfig.from_dir(quantized)
    tensors, dense = load_file(str(quantized / "model.safetensors")), load_file(str(twin / "model.safetensors"))
    p = "model.layers.1."
    for rank in range(2):
        _set_rank(monkeypatch, rank, 2)
        qkv = QKVParallelLinear(128, 32, 4, 2, quant=linear_format(cfg.quantization, p + "self_attn.",
                                                                   ("q_proj", "k_proj", "v_proj")))
        gate_up = MergedColumnParallelLinear(128, [384, 384], quant=linear_format(cfg.quantization, p + "mlp.",
                                                                                  ("gate_proj", "up_proj")))
        down = RowParallelLinear(384, 128, quant=linear_format(cfg.quantization, p + "mlp.", ("down_proj",)))
        for layer, parts, mod in ((qkv, {"q_proj": "q", "k_proj": "k", "v_proj": "v"}, "self_attn."),
                                  (gate_up, {"gate_proj": 0, "up_proj": 1}, "mlp."),
                                  (down, {"down_proj": None}, "mlp.")):
            for part, shard in parts.items():
                prefix = f"{p}{mod}{part}."
                for name, t in tensors.items():
                    if name.startswith(prefix):
                        layer.load_weight(name.removeprefix(prefix), t, shard)
        w = {k: dense[f"{p}{m}.weight"] for k, m in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"),
                                                    ("v", "self_attn.v_proj"), ("g", "mlp.gate_proj"),
                                                    ("u", "mlp.up_proj"), ("d", "mlp.down_proj"))}
        want_qkv = torch.cat([w["q"].chunk(2)[rank], w["k"].chunk(2)[rank], w["v"].chunk(2)[rank]])
        assert torch.equal(qkv.quant.dequantize(qkv, torch.float32), want_qkv)
        want_gate_up = torch.cat([w["g"].chunk(2)[rank], w["u"].chunk(2)[rank]])
        assert torch.equal(gate_up.quant.dequantize(gate_up, torch.float32), want_gate_up)
        assert torch.equal(down.quant.dequantize(down, torch.float32), w["d"].chunk(2, dim=1)[rank])


def test_tp_size_that_splits_an_fp8_block_is_refused(ckpts, monkeypatch):
    """The ragged model's gate/up have 352 rows: 176 per rank at TP 2 split a 32-row block."""
    cfg = ModelConfig.from_dir(ckpts["fp8-ragged"][0])
    _set_rank(monkeypatch, 0, 2)
    with pytest.raises(ConfigError) as e:
        CausalLM(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "model.layers.0.mlp.gate_proj+up_proj: this rank's rows 0..176 of 352" in msg, msg
    assert "would split a 32x64 fp8 block (32 rows each)" in msg, msg
    assert "tensor-parallel size (now 2)" in msg, msg


def test_a_tensor_of_the_wrong_dtype_is_a_checkpoint_error(ckpts, tmp_path):
    quantized, _ = ckpts["fp8"]
    tensors = load_file(str(quantized / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].to(torch.bfloat16)  # an unquantized weight where fp8 is declared
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((quantized / "config.json").read_text())
    with pytest.raises(CheckpointError, match=f"tensor '{name}' has dtype torch.bfloat16, expected torch.float8_e4m3fn"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_a_config_and_tensors_that_disagree_on_quantization_say_so(ckpts, tmp_path):
    """An INT4 config over plain tensors, and plain config over INT4 tensors: the error names the disagreement, not
    "no such weight" for a weight the architecture has."""
    quantized, twin = ckpts["int4"]
    for tensors, config, why in ((twin, quantized, r"\.weight' \(stored unquantized, but the config's "
                                                   r"quantization_config quantizes this layer: expected "
                                                   r"weight_packed, weight_scale, weight_shape\)"),
                                 (quantized, twin, r"\.weight_(packed|scale|shape)' \(a quantized part, but the "
                                                   r"config's quantization_config does not quantize this layer "
                                                   r"\(weight\)\)")):
        folder = tmp_path / f"{tensors.name}-under-{config.name}-config"
        folder.mkdir()
        (folder / "model.safetensors").symlink_to(tensors / "model.safetensors")
        for extra in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            if (config / extra).is_file():
                (folder / extra).write_text((config / extra).read_text())
        with pytest.raises(CheckpointError, match=why):
            LLMEngine(EngineConfig(model=str(folder)))


@pytest.mark.slow
@pytest.mark.xdist_group("procs")  # TP ranks: one at a time with the others (conftest.py)
def test_tp2_equals_tp1(ckpts, tmp_path):
    jobs = [dict(model=str(ckpts[c][0]), tp_size=2, prompts=PROMPTS, max_new_tokens=MAX_NEW) for c in ("int4", "fp8")]
    (tmp_path / "spec.json").write_text(json.dumps(jobs))
    runner = Path(__file__).resolve().parent / "tp_runner.py"
    proc = subprocess.Popen([sys.executable, str(runner), str(tmp_path / "spec.json"), str(tmp_path / "out.pt")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("TP=2 run did not finish in 240 s")
    assert proc.returncode == 0, log[-4000:]
    for case, res in zip(("int4", "fp8"), torch.load(tmp_path / "out.pt")):
        tp1 = run(ckpts[case][0])
        assert_rel(res["packed_logits"], tp1["logits"], 1e-4, f"{case} TP 2 logits")
        assert_rel(res["features"], tp1["features"], 1e-4, f"{case} TP 2 features")
        greedy = [g[:MAX_NEW - 3 * i] for i, g in enumerate(tp1["greedy"])]  # the runner shortens later prompts
        assert res["greedy"] == greedy, case


def test_eagle3_speculation_on_an_int4_target_is_token_identical(ckpts, tmp_path):
    from draft_checkpoints import make_draft
    from tandem.configs.eagle3 import DraftConfig, validate_draft
    from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
    from tandem.speculative.spec_config import SpecConfig
    from proposers import always_speculate

    target = ckpts["int4"][0]
    make_draft(tmp_path / "draft", ModelConfig.from_dir(target), seed=5, aux_layer_ids=(0, 1, 2))
    ref = run(target)["greedy"]
    capture = validate_draft(DraftConfig.from_dir(tmp_path / "draft"), ModelConfig.from_dir(target))
    spec = SpecConfig(3, 2, 6)
    cfg = EngineConfig(model=str(target), capture_layers=capture)
    with LLMEngine(cfg, spec=spec, policy=always_speculate()) as eng:
        eng.proposer = Eagle3Drafter.from_dirs(str(tmp_path / "draft"), str(target), DrafterConfig(),
                                               capture_layers=capture,
                                               embed_weight=eng.executor.runner.model.model.embed_tokens.weight)
        eng.default_spec = spec
        results = eng.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert [r.output_token_ids for r in results] == ref
    assert all(r.spec_stats.rounds > 0 for r in results)


def test_a_stack_of_experts_loads_and_dequantizes_per_expert():
    """The hook the MoE layer uses: one format over [experts, out, in], loaded expert by expert."""
    from quantized_checkpoints import int4_compress
    from tandem.layers.linear import Span
    from tandem.layers.quantized_linear import Int4GroupFormat
    from tandem.configs.quantization import Int4Group

    class Experts(torch.nn.Module):
        cols = Span.whole(64)

        def row_spans(self):
            return [Span.whole(48)]

    layer, fmt = Experts(), Int4GroupFormat("mlp.experts", Int4Group(32, "bfloat16"))
    fmt.create(layer, 48, 64, leading=(3,))
    g = torch.Generator().manual_seed(0)
    want = []
    for e in range(3):
        packed, deq = int4_compress((torch.randn(48, 64, generator=g) * 0.1).to(torch.bfloat16), 32)
        if e == 1:  # a checkpoint mixing scale dtypes: an exact float32 copy loads into the bf16 stack
            packed["weight_scale"] = packed["weight_scale"].float()
        for name, t in packed.items():
            fmt.load(layer, name, t, Span.whole(48), Span.whole(64), expert=e)
        want.append(deq)
    assert layer.weight_scale.dtype == torch.bfloat16
    assert torch.equal(fmt.dequantize(layer, torch.float32), torch.stack(want))
    # a float32 scale bf16 cannot hold is refused, not rounded
    inexact = packed["weight_scale"].float() * (1 + 2 ** -12)
    with pytest.raises(ValueError, match="has dtype torch.float32, expected torch.bfloat16"):
        fmt.load(layer, "weight_scale", inexact, Span.whole(48), Span.whole(64), expert=0)


def test_fused_parts_that_split_a_block_at_one_rank_say_so_not_choose_a_tp_size(ckpts, monkeypatch):
    """Blocks taller than gate's rows (a checkpoint whose intermediate size is not a multiple of the block's rows):
    up starts inside a block at TP 1 too, and the message says what the checkpoint lacks (a user sweep was told to
    change a tensor-parallel size of 1)."""
    import dataclasses

    from tandem.configs.quantization import Fp8Block

    cfg = ModelConfig.from_dir(ckpts["fp8"][0])
    rows = 2 * cfg.intermediate_size  # taller than gate's rows: up's first row falls inside gate's block
    cfg = dataclasses.replace(cfg, quantization=dataclasses.replace(cfg.quantization, scheme=Fp8Block((rows, 64))))
    _set_rank(monkeypatch, 0, 1)
    with pytest.raises(ConfigError) as e:
        CausalLM(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "choose a tensor-parallel size" not in msg, msg
    assert "the parts fused into this projection must each hold whole" in msg and "not supported" in msg, msg
