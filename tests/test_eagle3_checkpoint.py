"""Draft checkpoints in the SGLang/SpecForge format: exact tensor names and shapes, config fields,
save → load round trips, config parsing variants, and one-line load errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draft_checkpoints import design_tensor_shapes, edit_config, make_draft, rewrite_tensors
from tandem.errors import CheckpointError
from tandem.models.eagle3_checkpoint import load_eagle3, save_eagle3
from tandem.configs.eagle3 import DraftConfig
from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
from tandem.speculative.spec_config import SpecConfig

H, HT, Q, KV, I, VD, V = 64, 64, 64, 32, 128, 200, 256  # draft/target hidden, q/kv widths, mlp, vocabs
DESIGN_TENSORS = design_tensor_shapes(H, HT, Q, KV, I, VD, V)


def tensor_shapes(draft_dir: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_written_checkpoint_has_exactly_the_design_tensors(pair):
    assert tensor_shapes(pair.draft_dir) == DESIGN_TENSORS
    with safe_open(str(pair.draft_dir / "model.safetensors"), framework="pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert torch.equal(t2d.nonzero().flatten(), torch.arange(VD) + d2t)  # t2d marks exactly the mapped ids
    raw = json.loads((pair.draft_dir / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["model_type"] == "llama"
    assert raw["num_hidden_layers"] == 1 and raw["tie_word_embeddings"] is False
    assert (raw["draft_vocab_size"], raw["vocab_size"], raw["target_hidden_size"]) == (VD, V, HT)
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert raw["torch_dtype"] == "float32"


def test_save_load_round_trip_gives_identical_proposals(pair, tmp_path):
    head = load_eagle3(pair.draft_dir, pair.embed)
    save_eagle3(head, head.config, tmp_path / "copy")
    assert tensor_shapes(tmp_path / "copy") == DESIGN_TENSORS
    unplaced = [dataclasses.replace(DraftConfig.from_dir(d), model_dir=None) for d in (pair.draft_dir, tmp_path / "copy")]
    assert unplaced[0] == unplaced[1]
    g = torch.Generator().manual_seed(0)
    tokens, feats = torch.randint(0, V, (9,), generator=g).tolist(), torch.randn(9, 3 * HT, generator=g)
    trees = []
    for d in (pair.draft_dir, tmp_path / "copy"):
        drafter = Eagle3Drafter.from_dirs(str(d), str(pair.target_dir), DrafterConfig(kv_pages=64))
        drafter.extend([("r", tokens, feats)])
        trees.append(drafter.draft(["r"], SpecConfig(4, 3, 12)))
    assert trees[0] == trees[1]


def test_bfloat16_checkpoint_loads_as_bfloat16(pair, tmp_path):
    make_draft(tmp_path / "bf16", pair.target, dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    head = load_eagle3(tmp_path / "bf16", pair.embed.bfloat16(), dtype=torch.bfloat16)
    assert head.fc.weight.dtype == torch.bfloat16 and head.d2t.dtype == torch.int64


def test_draft_with_its_own_embedding_uses_it(pair, tmp_path):
    draft = tmp_path / "own"
    make_draft(draft, pair.target)
    own = torch.randn(V, H)
    rewrite_tensors(draft, {"embed_tokens.weight": own})
    head = load_eagle3(draft, pair.embed)  # the target's embedding is offered but the checkpoint's wins
    assert torch.equal(head.embed_weight, own)
    save_eagle3(head, head.config, tmp_path / "again")
    assert tensor_shapes(tmp_path / "again")["embed_tokens.weight"] == (V, H)


def test_missing_t2d_is_derived_from_d2t(pair, tmp_path):
    draft = tmp_path / "no_t2d"
    make_draft(draft, pair.target)
    rewrite_tensors(draft, drop=("t2d",))
    head = load_eagle3(draft, pair.embed)
    assert int(head.t2d.sum()) == VD and bool(head.t2d[head.to_target_ids(torch.arange(VD))].all())


@pytest.mark.parametrize(
    "surgery,message",
    [
        (dict(drop=("midlayer.hidden_norm.weight",)), "missing tensor 'midlayer.hidden_norm.weight'"),
        (dict(replace={"midlayer.self_attn.k_proj.weight": torch.zeros(48, 2 * H)}),
         "tensor 'midlayer.self_attn.k_proj.weight' has shape (48, 128), expected (32, 128)"),
        (dict(replace={"midlayer.fc_norm.weight": torch.ones(H)}), "unexpected tensor 'midlayer.fc_norm.weight'"),
    ],
)
def test_load_errors_are_one_line(pair, tmp_path, surgery, message):
    draft = tmp_path / "bad"
    make_draft(draft, pair.target)
    rewrite_tensors(draft, **surgery)
    with pytest.raises(CheckpointError) as e:
        load_eagle3(draft, pair.embed)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_parsing_variants(pair, tmp_path):
    draft = tmp_path / "cfg"
    make_draft(draft, pair.target)
    base = DraftConfig.from_dir(draft)
    assert base.capture_layers(pair.target) == (1, 3, 4)  # outputs of 0, 2, 3 = inputs of 1, 3, 4
    # EAGLE's own training repo: plain LlamaForCausalLM, one layer, draft_vocab_size present.
    edit_config(draft, architectures=["LlamaForCausalLM"])
    assert DraftConfig.from_dir(draft).draft_vocab_size == VD
    edit_config(draft, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=None, target_hidden_size=None,
                head_dim=None, eagle_config=None, eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    cfg = DraftConfig.from_dir(draft)
    assert (cfg.draft_vocab_size, cfg.target_hidden_size, cfg.head_dim) == (V, H, H // 4)
    assert cfg.capture_layers(pair.target) == (2, 3, 4)  # top-level ids (newer SGLang) are read too
    edit_config(draft, eagle_aux_hidden_state_layer_ids=None)
    assert DraftConfig.from_dir(draft).capture_layers(pair.target) == pair.target.default_capture_layers()
    edit_config(draft, architectures=["LlamaForCausalLM"], draft_vocab_size=None)
    with pytest.raises(CheckpointError, match="not an EAGLE-3 draft .*looks like EAGLE-1/2.*expected LlamaForCausalLMEagle3"):
        DraftConfig.from_dir(draft)


def test_config_and_validation_modules_do_not_import_torch(pair):
    code = (
        "import sys; from tandem.configs.model import ModelConfig; "
        "from tandem.configs.eagle3 import DraftConfig, validate_draft; "
        f"print(validate_draft(DraftConfig.from_dir({str(pair.draft_dir)!r}), ModelConfig.from_dir({str(pair.target_dir)!r}))); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(1, 3, 4)"
