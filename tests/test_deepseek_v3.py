"""DeepSeek-V3 (MLA + MoE) against transformers' own DeepseekV3ForCausalLM on tiny random checkpoints
written by its save_pretrained: logits of every form of attention (plain prefill, absorbed decode,
chunks, a tree), 64-token greedy generation, a batch over scattered pages, the routing, and the
Kimi-K2.5 wrapper folder."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from deepseek_checkpoints import deepseek_config, write_deepseek, write_kimi_k25
from helpers import assert_rel, hf_greedy, hf_logits, manual_greedy_logits, random_prompt
from tandem.forward_batch import ForwardBatch, SequenceChunk
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.kv_cache import SequenceKV
from tandem.configs.model import ModelConfig
from tandem.sampling import SamplingParams

VOCAB = 512
# q_lora + two expert groups (one kept) | DeepSeek-V2-style q_proj + one group; YaRN in both | YaRN without
# mscale_all_dim (cos/sin scaled by mscale(factor), the softmax scale left alone), 4 groups of 2 keeping 2.
VARIANTS = {
    "q_lora-groups2": {},
    "no_q_lora-group1": dict(q_lora_rank=None, n_group=1, topk_group=1),
    "yarn_factor_only-groups4": dict(n_group=4, topk_group=2, rope_parameters={
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 2048}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for i, (name, overrides) in enumerate(VARIANTS.items()):
        path = tmp_path_factory.mktemp(f"deepseek-{name}")
        out[name] = (str(path), write_deepseek(path, seed=11 + i, **overrides))
    return out


@pytest.fixture(scope="module")
def engines(models):
    opened = {name: LLMEngine(EngineConfig(model=path, page_size=8)) for name, (path, _) in models.items()}
    yield opened
    for eng in opened.values():
        eng.shutdown()


def test_config_reads_mla_moe_and_yarn(models):
    cfg = ModelConfig.from_dir(models["q_lora-groups2"][0])
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size) == ("DeepseekV3ForCausalLM", 8, 64)
    assert (cfg.mla.q_lora_rank, cfg.mla.cache_dim, cfg.mla.qk_head_dim, cfg.mla.v_head_dim) == (32, 24, 24, 24)
    assert cfg.mla.yarn.factor == 4.0 and cfg.mla.yarn.attention_factor == 1.0
    assert cfg.mla.softmax_scale == pytest.approx(24**-0.5 * (0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)
    assert (cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.first_k_dense_replace) == (2, 1, 1)
    assert ModelConfig.from_dir(models["no_q_lora-group1"][0]).mla.q_lora_rank is None
    other = ModelConfig.from_dir(models["yarn_factor_only-groups4"][0]).mla
    assert other.yarn.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(8.0)).item() + 1)
    assert other.softmax_scale == pytest.approx(24**-0.5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_prompt_logits_match_hf(models, engines, variant):
    """A fresh prompt: the plain (non-absorbed) form, over several pages."""
    prompt = random_prompt(1, 100, VOCAB)
    assert_rel(engines[variant].prompt_logits(prompt), hf_logits(models[variant][1], prompt), 1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_and_chunk_logits_match_hf(models, engines, variant):
    """The absorbed form: one token at a time against the cache, and a 40-token chunk after 30 cached."""
    eng, hf = engines[variant], models[variant][1]
    tokens, rows = manual_greedy_logits(eng, random_prompt(2, 9, VOCAB), 12)
    assert_rel(rows, hf_logits(hf, tokens)[8:], 1e-4, "decode")
    prompt = random_prompt(3, 70, VOCAB)
    kv = SequenceKV(eng.allocator)
    try:
        kv.reserve(70)
        eng.executor.forward(ForwardBatch([SequenceChunk(prompt[:30], 0, kv.page_table(), logits="none")]))
        logits, _ = eng.executor.forward(ForwardBatch([SequenceChunk(prompt[30:], 30, kv.page_table(), logits="all")]))
    finally:
        kv.release()
    assert_rel(logits, hf_logits(hf, prompt)[30:], 1e-4, "chunk")


def test_tree_verification_logits_match_hf(models, engines):
    """A tree of 5 nodes after a cached prefix (root's children a, b; a's c, d; b's e): every node's
    logits are those of the sequence prefix + its path, as a verify would use them."""
    eng, hf = engines["q_lora-groups2"], models["q_lora-groups2"][1]
    prefix, nodes, parents = random_prompt(4, 21, VOCAB), [7, 8, 9, 10, 11], [-1, -1, 0, 0, 1]
    depth = [0, 0, 1, 1, 1]
    mask = [[j == i or (parents[i] == j) for j in range(5)] for i in range(5)]
    kv = SequenceKV(eng.allocator)
    try:
        kv.reserve(len(prefix) + 5)
        eng.executor.forward(ForwardBatch([SequenceChunk(prefix, 0, kv.page_table(), logits="none")]))
        tree = SequenceChunk(nodes, len(prefix), kv.page_table(), positions=[len(prefix) + d for d in depth],
                             tree_mask=mask, logits="all")
        logits, _ = eng.executor.forward(ForwardBatch([tree]))
    finally:
        kv.release()
    for i in range(5):
        path = [nodes[parents[i]], nodes[i]] if parents[i] >= 0 else [nodes[i]]
        assert_rel(logits[i], hf_logits(hf, prefix + path)[-1], 1e-4, f"node {i}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_matches_hf(models, engines, variant):
    prompt = random_prompt(5, 7, VOCAB)
    [result] = engines[variant].generate([prompt], SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert result.output_token_ids == hf_greedy(models[variant][1], prompt, 64)


def test_batch_of_lengths_over_scattered_pages(models):
    path, hf = models["q_lora-groups2"]
    prompts = [random_prompt(10 + n, n, VOCAB) for n in (3, 17, 40, 66)]
    cfg = EngineConfig(model=path, page_size=4, page_shuffle_seed=7, chunked_prefill_size=48)
    with LLMEngine(cfg) as eng:
        results = eng.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert [r.output_token_ids for r in results] == [hf_greedy(hf, p, 16) for p in prompts]


def test_noaux_tc_routing_matches_hf():
    """Our router against transformers' DeepseekV3TopkRouter on the same weights, with a bias that
    makes some biased scores negative (where masking unselected groups with 0 would differ)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from tandem.layers.moe_router import NoAuxRouter

    for groups, kept, topk in ((4, 2, 3), (1, 1, 2)):
        cfg = deepseek_config(n_routed_experts=16, n_group=groups, topk_group=kept, num_experts_per_tok=topk)
        hf = DeepseekV3TopkRouter(cfg)
        torch.manual_seed(groups)
        hf.weight.data.normal_(0, 0.5)
        hf.e_score_correction_bias.normal_(-0.6, 0.3)
        ours = NoAuxRouter(cfg.hidden_size, ModelConfig.from_hf_dict({**cfg.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}).moe)
        ours.load_weight("weight", hf.weight.data)
        ours.load_weight("e_score_correction_bias", hf.e_score_correction_bias)
        x = torch.randn(64, cfg.hidden_size)
        _, ref_w, ref_ids = hf(x)
        weights, ids = ours(x)
        ref_order, order = ref_ids.argsort(-1), ids.argsort(-1)
        assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
        assert_rel(weights.gather(1, order), ref_w.gather(1, ref_order), 1e-6, "weights")


def test_kimi_k25_wrapper_loads_text_only(models, tmp_path, caplog):
    """The wrapper's config (text_config), its language_model.* tensors; the vision tower, projector and
    an MTP layer are skipped and named in one log line."""
    from safetensors.torch import load_file, save_file

    src, hf = models["q_lora-groups2"]
    write_kimi_k25(Path(src), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["language_model.model.layers.8.eh_proj.weight"] = torch.zeros(64, 128)  # DeepSeek's MTP layer
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.architecture == "KimiK25ForConditionalGeneration" and cfg.checkpoint_prefix == "language_model."
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["model_type"] == "kimi_k2"
    prompt = random_prompt(6, 40, VOCAB)
    with caplog.at_level(logging.INFO, logger="tandem.models"), LLMEngine(EngineConfig(model=str(tmp_path))) as eng:
        ours = eng.prompt_logits(prompt)
    assert_rel(ours, hf_logits(hf, prompt), 1e-4)
    [line] = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert "3 tensors" in line and all(n in line for n in ("mm_projector.*", "vision_tower.*", "model.layers.8.*"))


def test_unsupported_routing_is_refused_by_name(models, tmp_path):
    from tandem.errors import CheckpointError

    raw = json.loads((Path(models["q_lora-groups2"][0]) / "config.json").read_text())
    with pytest.raises(CheckpointError, match="topk_method=greedy, scoring_func=softmax is not supported"):
        ModelConfig.from_hf_dict({**raw, "topk_method": "greedy", "scoring_func": "softmax"})


def test_routing_groups_that_cannot_work_are_named_plainly(models):
    from tandem.errors import CheckpointError

    raw = json.loads((Path(models["q_lora-groups2"][0]) / "config.json").read_text())
    with pytest.raises(CheckpointError, match="topk_group 4 exceeds n_group 1"):
        ModelConfig.from_hf_dict({**raw, "n_group": 1, "topk_group": 4})
    with pytest.raises(CheckpointError, match=r"experts do not form 3 groups of at least 2"):
        ModelConfig.from_hf_dict({**raw, "n_group": 3, "topk_group": 1})
