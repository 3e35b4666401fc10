"""The quantized-engines benchmark section (bench/sections_quant_engines.py) on the CPU at tiny dims: its
config-only folders start with random weights and decode, and its per-token byte counts equal an
independent count, the bytes of the started engine's parameters one token reads at batch 1 (every
parameter but the embedding and the ``weight_shape`` records; of the routed experts only ``top-k``).
The section itself needs a GPU."""

from __future__ import annotations

import pytest
import torch
from bench_modules import import_bench

from helpers import random_prompt
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.models.random_checkpoint import LlamaShape
from tandem.sampling import SamplingParams

# head_dim 128: k and v each one whole 128-row FP8 block of the fused qkv (as at the 8B shape)
TINY_LLAMA = LlamaShape(vocab_size=256, hidden_size=256, intermediate_size=384, num_layers=2, num_heads=2,
                        num_kv_heads=1)
TINY_MOE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=None,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
                n_group=1, topk_group=1, vocab_size=256)


@pytest.fixture
def section(tmp_path, monkeypatch):
    models, deepseek, section = import_bench("models", "sections_deepseek", "sections_quant_engines")
    monkeypatch.setattr(models, "_ROOT", tmp_path)  # the folders' cache, where target_dir / deepseek_dir write
    monkeypatch.setattr(deepseek, "_ROOT", tmp_path)
    return section


def read_bytes(model, top_k: int = 0) -> int:
    """Bytes of the parameters one token reads: all but the embedding and the shape records; of the routed
    experts only the first ``top_k`` (they are all alike)."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or name.endswith("weight_shape"):
            continue
        if ".mlp.experts." in name and int(name.split(".mlp.experts.")[1].split(".")[0]) >= top_k:
            continue
        total += p.numel() * p.element_size()
    return total


def start_and_decode(path) -> torch.nn.Module:
    with LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="bfloat16", load_format="random")) as eng:
        out = eng.generate([random_prompt(5, 6, 256)], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(out[0].output_token_ids) == 3
        return eng.executor.runner.model


@pytest.mark.parametrize("scheme", ["int4", "fp8"])
def test_the_llama_folder_starts_and_its_bytes_are_what_one_token_reads(section, scheme):
    case = section.llama_case(scheme, TINY_LLAMA, "tiny")
    model = start_and_decode(case.path)
    quantized = {type(m.quant).__name__ for m in model.modules() if getattr(m, "quant", None) is not None}
    assert quantized == {"Int4GroupFormat" if scheme == "int4" else "Fp8BlockFormat"}
    assert case.weight_bytes == read_bytes(model)
    assert case.speculate == (scheme == "int4") and case.goal == 0.75


def test_the_moe_folder_starts_and_its_bytes_are_what_one_token_reads(section):
    case = section.moe_case("tiny", TINY_MOE)
    model = start_and_decode(case.path)
    layers = model.model.layers
    assert layers[1].mlp.experts[0].down_proj.quant is not None  # the routed experts INT4 ...
    assert layers[1].mlp.shared_experts.down_proj.quant is None  # ... and nothing else
    assert layers[0].mlp.down_proj.quant is None and layers[1].self_attn.o_proj.quant is None
    norms = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 1 and p.is_floating_point())
    # the count leaves out the norms and the correction biases (vectors, a few KB)
    assert case.weight_bytes == read_bytes(model, TINY_MOE["num_experts_per_tok"]) - norms
    assert case.goal == 0.60 and not case.speculate


def test_the_section_is_registered_with_all_four_targets():
    section_index, section = import_bench("section_index", "sections_quant_engines")
    assert section_index.SECTIONS["quant_engines"] is section.quant_engines
    names = [c.name for c in section.cases()]
    assert names == ["llama8b int4", "llama8b fp8", "v2-lite int4 experts", "kimi-k2 int4 experts"]
    fp8 = section.cases()[1]
    assert 7.9e9 < fp8.weight_bytes < 8.2e9  # the "≈ 8 GB read per token"


def test_the_section_runs_through_on_tiny_cases(section, tmp_path, monkeypatch):
    """Its rows from CPU engines (the GPU's parts stubbed: graphs, the drafter); a case that cannot start is
    reported and the next still runs."""
    def cpu_engine(path, widths, max_bs, kv_pages):
        engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="bfloat16", load_format="random"))
        engine.executor.runner.graph_report = {"widths": widths, "max_bs": max_bs}
        return engine

    speculated = []
    tiny = [section.llama_case("int4", TINY_LLAMA, "tiny"), section.moe_case("tiny", TINY_MOE),
            section.Case("missing", tmp_path / "missing", 1, 0.6, False), section.llama_case("fp8", TINY_LLAMA, "tiny")]
    for name, value in {"random_weight_engine": cpu_engine, "free_gpu": lambda: None,
                        "speculation_rows": lambda engine, path, *args: speculated.append(args) or [{}],
                        "cases": lambda layers: tiny}.items():
        monkeypatch.setattr(section, name, value)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    out = section.quant_engines({"quick": True, "layers": None, "copy_tbps": 4.0})
    assert list(out) == [c.name for c in tiny]
    assert "error" in out["missing"] and "decode" in out["tiny fp8"]
    for case in (tiny[0], tiny[1], tiny[3]):
        rows = out[case.name]["decode"]
        assert [r["batch"] for r in rows] == [1, 8] and 0 < rows[0]["of_limit"] and rows[0]["tok_s"] > 0
        assert out[case.name]["capture"]["widths"] == ((1, 4) if case.speculate else (1,))
    assert speculated == [((1,), (section.ACCEPT_GOAL,), 48)] and out["tiny int4"]["speculation"] == [{}]
