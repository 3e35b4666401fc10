"""EAGLE-3 on DeepSeek-V3 targets: greedy speculative decoding with a random head (chains and trees,
verified in the absorbed MLA form) is token-identical to transformers' greedy output, and so are trees
from an oracle that puts transformers' continuation in them (accepted paths, not always the first
child, compacted in the latent cache); the head's layer
ids follow SGLang's id + 1 rule; a head for a Kimi-K2.5 wrapper folder reads the embedding under its
prefix; and at Kimi-K2's real width (7168) start-up validation accepts fc 21504 -> 7168 and refuses an
EAGLE-1/2-width head naming both widths (checked from tensor headers: the weights are sparse files)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from deepseek_checkpoints import write_deepseek, write_kimi_k25
from proposers import RandomTreeProposer, always_speculate
from draft_checkpoints import make_draft
from helpers import hf_greedy, random_prompt
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.errors import CheckpointError
from tandem.configs.model import ModelConfig
from tandem.configs.eagle3 import DraftConfig, validate_draft
from tandem.sampling import SamplingParams
from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
from tandem.speculative.spec_config import SpecConfig
from tandem.engine.speculative_setup import speculative_engine

VOCAB = 512
AUX_IDS = (0, 3, 5)  # outputs of layers 0, 3, 5 = inputs of 1, 4, 6 (the 8-layer default would be 2, 4, 5)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-eagle3")
    hf = write_deepseek(root / "target", seed=21)
    target = ModelConfig.from_dir(root / "target")
    # A Llama-shaped head as published for Kimi (MHA over the target's width), here 4 heads of 16.
    make_draft(root / "draft", target, seed=3, aux_layer_ids=AUX_IDS, num_heads=4, num_kv_heads=4, head_dim=16)
    prompts = [random_prompt(30 + n, n, VOCAB) for n in (5, 23)]
    return root, hf, prompts, [hf_greedy(hf, p, 24) for p in prompts]


def test_capture_layers_follow_the_id_plus_one_rule(pair):
    root = pair[0]
    target = ModelConfig.from_dir(root / "target")
    assert target.default_capture_layers() == (2, 4, 5)
    assert validate_draft(DraftConfig.from_dir(root / "draft"), target) == (1, 4, 6)


@pytest.mark.parametrize("spec", [SpecConfig(3, 1, 4), SpecConfig(3, 2, 6)], ids=["chain", "tree"])
def test_greedy_speculation_is_token_identical_to_hf(pair, spec):
    root, _, prompts, ref = pair
    cfg = EngineConfig(model=str(root / "target"), page_size=4, page_shuffle_seed=3)
    with speculative_engine(cfg, str(root / "draft"), spec, policy=always_speculate()) as eng:
        assert eng.executor.runner.capture_layers == (1, 4, 6)
        results = eng.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [r.output_token_ids for r in results] == ref
    assert all(r.spec_stats.rounds > 0 for r in results)


def test_accepted_tree_paths_are_compacted_in_the_latent_cache(pair):
    from proposers import Spec

    root, _, prompts, ref = pair
    oracle = {f"r{i}": p + e for i, (p, e) in enumerate(zip(prompts, ref))}
    proposer = RandomTreeProposer(vocab=VOCAB, seed=4, oracle=oracle, hit_rate=0.8)
    cfg = EngineConfig(model=str(root / "target"), page_size=3, page_shuffle_seed=5)
    with LLMEngine(cfg, proposer=proposer, spec=Spec(8), policy=always_speculate()) as eng:
        rids = [eng.add_request(p, SamplingParams(max_new_tokens=24, ignore_eos=True), rid=f"r{i}")
                for i, p in enumerate(prompts)]
        while eng.has_unfinished():
            eng.step()
        got, stats = [eng.requests[r].output for r in rids], [eng.requests[r].spec_stats for r in rids]
        assert eng.allocator.num_free == eng.allocator.capacity_pages
    assert got == ref
    assert min(s.accept_length_mean for s in stats) > 1.5


def test_a_drafter_for_a_kimi_k25_folder_reads_the_prefixed_embedding(pair, tmp_path):
    root, hf = pair[0], pair[1]
    write_kimi_k25(root / "target", tmp_path / "kimi")
    drafter = Eagle3Drafter.from_dirs(str(root / "draft"), str(tmp_path / "kimi"), DrafterConfig())
    assert drafter.capture_layers == (1, 4, 6)
    assert torch.equal(drafter.head.embed_weight, hf.model.embed_tokens.weight)


# Kimi-K2-Instruct's shape (../shared/reference/deepseek_v3_kimi.md §1)
KIMI_K2 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", vocab_size=163840, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
    num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1,
    moe_layer_freq=1, n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
    routed_scaling_factor=2.827, rope_theta=50000.0, max_position_embeddings=131072, rms_norm_eps=1e-6,
    rope_scaling=dict(type="yarn", factor=32.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096,
                      beta_fast=1.0, beta_slow=1.0),
    torch_dtype="bfloat16", num_nextn_predict_layers=0,
)


def write_header_only_draft(path: Path, fc_in: int, hidden: int = 7168, draft_vocab: int = 32000) -> Path:
    """An EAGLE-3 head folder whose fc.weight [hidden, fc_in] is a sparse hole: its header is all
    validation reads. d2t is real (validation checks its ids)."""
    path.mkdir(parents=True)
    config = dict(architectures=["LlamaForCausalLMEagle3"], hidden_size=hidden, intermediate_size=18432,
                  num_attention_heads=64, num_key_value_heads=8, head_dim=128, num_hidden_layers=1,
                  vocab_size=163840, draft_vocab_size=draft_vocab, target_hidden_size=hidden,
                  max_position_embeddings=131072, rope_theta=50000.0, torch_dtype="bfloat16",
                  eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 29, 57]})
    (path / "config.json").write_text(json.dumps(config))
    d2t = torch.zeros(draft_vocab, dtype=torch.int64).numpy().tobytes()
    fc_bytes = hidden * fc_in * 2
    header = {"d2t": {"dtype": "I64", "shape": [draft_vocab], "data_offsets": [0, len(d2t)]},
              "fc.weight": {"dtype": "BF16", "shape": [hidden, fc_in], "data_offsets": [len(d2t), len(d2t) + fc_bytes]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + d2t)
        f.truncate(8 + len(raw) + len(d2t) + fc_bytes)
    return path


def test_kimi_k2_width_head_validates_and_eagle12_width_is_refused(tmp_path):
    target = ModelConfig.from_hf_dict(KIMI_K2)
    assert target.default_capture_layers() == (2, 30, 58)
    assert target.mla.cache_dim == 576 and target.mla.yarn.factor == 32.0
    good = write_header_only_draft(tmp_path / "eagle3", 3 * 7168)
    assert validate_draft(DraftConfig.from_dir(good), target) == (2, 30, 58)
    bad = write_header_only_draft(tmp_path / "eagle1", 7168)
    with pytest.raises(CheckpointError) as e:
        validate_draft(DraftConfig.from_dir(bad), target)
    assert str(e.value) == (
        "draft fc takes 7168-wide features but an EAGLE-3 head for this target needs 21504 (3 x 7168): "
        "this looks like an EAGLE-1/2 head; use an EAGLE-3 checkpoint"
    )
