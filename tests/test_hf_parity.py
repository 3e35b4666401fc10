"""The target engine against Hugging Face transformers on the same weights: per-position logits,
greedy generation, sharded checkpoints and a dtype override, for every supported family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import assert_rel, hf_greedy, hf_logits, random_prompt, rel_err
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling import SamplingParams

FAMILIES = ["llama", "qwen2", "qwen3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_match_hf(checkpoint, family):
    ckpt = checkpoint(family)
    # 100 tokens: past llama3's original_max_position_embeddings (64) and across several KV pages.
    prompt = random_prompt(1, 100)
    with LLMEngine(EngineConfig(model=ckpt.path)) as eng:
        ours = eng.prompt_logits(prompt)
    ref = hf_logits(ckpt.hf, prompt)
    assert ours.dtype == torch.float32
    assert_rel(ours, ref, 1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_hf(checkpoint, family):
    ckpt = checkpoint(family)
    prompt = random_prompt(2, 7)
    with LLMEngine(EngineConfig(model=ckpt.path)) as eng:
        [result] = eng.generate([prompt], SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert result.prompt_token_ids == prompt
    assert result.finish_reason == "length"
    assert result.output_token_ids == hf_greedy(ckpt.hf, prompt, 64)


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_checkpoint_matches_hf(checkpoint, family):
    ckpt = checkpoint(family, seed=5, max_shard_size="50KB")
    folder = Path(ckpt.path)
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    prompt = random_prompt(3, 40)
    with LLMEngine(EngineConfig(model=ckpt.path)) as eng:
        ours = eng.prompt_logits(prompt)
    assert_rel(ours, hf_logits(ckpt.hf, prompt), 1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_override(checkpoint, family):
    ckpt = checkpoint(family)
    prompt = random_prompt(4, 48)
    ref = hf_logits(ckpt.hf, prompt)
    with LLMEngine(EngineConfig(model=ckpt.path, dtype="bfloat16")) as eng:
        runner = eng.executor.runner
        assert runner.dtype == torch.bfloat16
        assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
        assert runner.kv.data.dtype == torch.bfloat16
        ours = eng.prompt_logits(prompt)
    assert ours.dtype == torch.float32  # logits are handed out in float32 whatever the compute dtype
    err = rel_err(ours, ref)
    assert err <= 5e-2, f"bf16 logits too far from float32: {err:.3g}"
    assert err > 1e-6, "bf16 logits identical to float32: the override did not take effect"
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"bf16 top-1 agrees with float32 at only {agree:.0%} of positions"


def test_float32_explicit_equals_auto_on_cpu(checkpoint):
    ckpt = checkpoint("llama")
    prompt = random_prompt(5, 20)
    with LLMEngine(EngineConfig(model=ckpt.path, dtype="float32")) as eng:
        assert eng.executor.runner.dtype == torch.float32
        ours = eng.prompt_logits(prompt)
    assert_rel(ours, hf_logits(ckpt.hf, prompt), 1e-4)


# Config variants the loader and model must honour (each against HF on the same weights).
VARIANTS = {
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=5e5)),
    "llama-plain-rope-tied": ("llama", dict(rope_scaling=None, tie_word_embeddings=True)),
    "llama-head-dim-32": ("llama", dict(head_dim=32)),  # head_dim != hidden / heads
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "qwen2-untied-theta-1e6": ("qwen2", dict(tie_word_embeddings=False, rope_theta=1e6)),
    # attention_bias: HF Llama and Qwen3 put a bias on q, k, v *and* o_proj.
    "llama-attention-bias": ("llama", dict(attention_bias=True)),
    "qwen3-attention-bias": ("qwen3", dict(attention_bias=True)),
    "llama-mlp-bias": ("llama", dict(mlp_bias=True)),  # gate/up/down biases
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_hf(checkpoint, variant):
    family, overrides = VARIANTS[variant]
    ckpt = checkpoint(family, seed=7, **overrides)
    prompt = random_prompt(6, 70)
    with LLMEngine(EngineConfig(model=ckpt.path)) as eng:
        ours = eng.prompt_logits(prompt)
    assert_rel(ours, hf_logits(ckpt.hf, prompt), 1e-4, variant)


def test_eos_ends_generation_like_hf(checkpoint):
    """With ignore_eos off, generation stops at the checkpoint's EOS (from generation_config.json),
    which is included in the output, exactly where HF's generate stops."""
    prompt = random_prompt(2, 7)
    greedy = hf_greedy(checkpoint("llama").hf, prompt, 64)
    eos = greedy[9]  # a token the greedy path reaches: make it the EOS of a same-weights checkpoint
    ckpt = checkpoint("llama", eos_token_id=eos)
    assert json.loads((Path(ckpt.path) / "generation_config.json").read_text())["eos_token_id"] == eos
    with torch.no_grad():
        hf_out = ckpt.hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64, pad_token_id=0)
    want = hf_out[0, len(prompt):].tolist()
    assert want[-1] == eos and len(want) < 64
    with LLMEngine(EngineConfig(model=ckpt.path)) as eng:
        [stopped] = eng.generate([prompt], SamplingParams(max_new_tokens=64))
        [ignored] = eng.generate([prompt], SamplingParams(max_new_tokens=64, ignore_eos=True))
        [stop_id] = eng.generate([prompt], SamplingParams(max_new_tokens=64, ignore_eos=True,
                                                          stop_token_ids=(greedy[4],)))
    assert stopped.output_token_ids == want and stopped.finish_reason == "stop"
    assert ignored.output_token_ids == greedy and ignored.finish_reason == "length"
    cut = greedy.index(greedy[4]) + 1
    assert stop_id.output_token_ids == greedy[:cut] and stop_id.finish_reason == "stop"


def test_generation_stops_at_the_context_length(checkpoint):
    ckpt = checkpoint("qwen2", seed=8, max_position_embeddings=32)
    prompts = [random_prompt(7, 20), random_prompt(8, 31)]
    with LLMEngine(EngineConfig(model=ckpt.path)) as eng:
        results = eng.generate(prompts, SamplingParams(max_new_tokens=50, ignore_eos=True))
    for prompt, r in zip(prompts, results):
        assert len(prompt) + len(r.output_token_ids) == 32 and r.finish_reason == "length"
        assert r.output_token_ids == hf_greedy(ckpt.hf, prompt, 32 - len(prompt))


def test_bfloat16_checkpoint_runs_in_float32_on_cpu(checkpoint, tmp_path):
    """A bf16 checkpoint with dtype=auto computes in float32 on CPU; logits equal HF's float32 model
    loaded from the same (bf16-rounded) weights."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "bf16"
    shutil.copytree(checkpoint("qwen3").path, folder)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = random_prompt(9, 30)
    with LLMEngine(EngineConfig(model=str(folder))) as eng:
        assert eng.executor.runner.dtype == torch.float32
        ours = eng.prompt_logits(prompt)
    assert_rel(ours, hf_logits(hf, prompt), 1e-4)


def test_tied_checkpoint_that_also_stores_lm_head_and_rotary_cache(checkpoint, tmp_path):
    """Some exporters write lm_head.weight for tied models, or rotary inv_freq buffers: both ignored."""
    ckpt = checkpoint("qwen2")
    folder = tmp_path / "extra"
    shutil.copytree(ckpt.path, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    prompt = random_prompt(10, 25)
    with LLMEngine(EngineConfig(model=str(folder))) as eng:
        ours = eng.prompt_logits(prompt)
    assert_rel(ours, hf_logits(ckpt.hf, prompt), 1e-4)


def test_prompt_logits_match_hf_when_attention_runs_in_row_blocks(checkpoint, monkeypatch):
    """The torch backend bounds its score matrix by attending a long prompt in blocks of query rows; with a
    bound that forces blocks of a few rows (and chunked prefill, so blocks meet a cached prefix), the logits
    are still transformers'."""
    import tandem.attention.torch_backend as torch_backend

    ckpt = checkpoint("llama")
    prompt = random_prompt(3, 100)
    monkeypatch.setattr(torch_backend, "SCORE_BYTES", 4 * 4 * 100 * 3)  # heads x keys x 3 rows of float32
    with LLMEngine(EngineConfig(model=ckpt.path, chunked_prefill_size=48)) as eng:
        ours = eng.prompt_logits(prompt)
    assert_rel(ours, hf_logits(ckpt.hf, prompt), 1e-4)
