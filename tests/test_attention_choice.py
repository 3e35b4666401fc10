"""--attention-backend as SGLang users pass it: names with no path for the model are taken as auto, said in the log,
and settled before the weights load (``triton`` on a dense model crashed after the load; ``flashinfer`` on a
DeepSeek-V3 one too)."""

from __future__ import annotations

import logging

import pytest
import torch

from tandem.attention.choice import resolve_backend

CPU = torch.device("cpu")


@pytest.mark.parametrize("name, latent, interpret, expected", [
    ("triton", False, "1", "auto"), ("flashinfer", True, "1", "auto"), ("triton", True, None, "auto"),
    ("triton", True, "1", "triton"), ("torch", True, None, "torch"),
    ("auto", True, None, "auto"), ("flashinfer", False, "1", "auto"),
])
def test_names_without_a_path_for_the_model_are_taken_as_auto(name, latent, interpret, expected, monkeypatch, caplog):
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    with caplog.at_level(logging.INFO, logger="tandem.attention"):
        assert resolve_backend(name, CPU, latent) == expected
    said = [r.getMessage() for r in caplog.records if "taken as auto" in r.getMessage()]
    assert bool(said) == (expected == "auto" and name != "auto"), said


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        resolve_backend("xformers", CPU, False)


def test_flashinfer_on_a_gpu_without_the_package_is_refused_before_the_load(monkeypatch):
    from tandem.attention import choice
    from tandem.errors import ConfigError

    monkeypatch.setattr(choice, "_flashinfer_importable", lambda: False)
    with pytest.raises(ConfigError, match="flashinfer cannot be imported"):
        resolve_backend("flashinfer", torch.device("cuda"), False)


def test_a_dense_engine_asked_for_triton_is_served(tmp_path):
    """(On the CPU auto is the torch reference, so the equality says only that it serves, not which kernel ran.)"""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.models.random_checkpoint import LlamaShape, write_random_llama
    from tandem.sampling import SamplingParams

    path = write_random_llama(tmp_path / "t", LlamaShape(vocab_size=300, hidden_size=64, intermediate_size=96,
                                                        num_layers=2, num_heads=4, num_kv_heads=2,
                                                        max_position_embeddings=128), seed=3)
    outputs = {}
    for name in ("torch", "triton"):
        with LLMEngine(EngineConfig(model=str(path), attention_backend=name)) as engine:
            outputs[name] = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0] \
                .output_token_ids
    assert outputs["triton"] == outputs["torch"]
