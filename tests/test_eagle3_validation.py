"""Start-up validation of a draft against its target: each mismatch is one line naming both numbers
and the fix, raised before any weight is loaded. Also the speculative flags' own validation."""

from __future__ import annotations

import pytest
import torch

from draft_checkpoints import edit_config, make_draft, rewrite_tensors
from tandem.errors import CheckpointError, ConfigError
from tandem.models.eagle3_checkpoint import load_eagle3
from tandem.configs.eagle3 import DraftConfig, validate_draft
from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
from tandem.speculative.spec_config import SpecConfig


@pytest.fixture
def draft(pair, tmp_path):
    make_draft(tmp_path / "draft", pair.target)
    return tmp_path / "draft"


def error_of(draft_dir, target, capture_layers=None) -> str:
    with pytest.raises((CheckpointError, ConfigError)) as e:
        validate_draft(DraftConfig.from_dir(draft_dir), target, capture_layers)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_a_good_pair_validates_to_its_capture_layers(pair):
    assert validate_draft(pair.draft, pair.target) == (1, 3, 4)
    assert validate_draft(pair.draft, pair.target, capture_layers=(4, 1, 3)) == (1, 3, 4)


def test_eagle12_width_fc_is_named(pair, draft):
    rewrite_tensors(draft, {"fc.weight": torch.zeros(64, 64)})  # one layer's hidden instead of three
    assert error_of(draft, pair.target) == (
        "draft fc takes 64-wide features but an EAGLE-3 head for this target needs 192 (3 x 64): "
        "this looks like an EAGLE-1/2 head; use an EAGLE-3 checkpoint"
    )


def test_other_fc_width(pair, draft):
    rewrite_tensors(draft, {"fc.weight": torch.zeros(64, 96)})
    assert error_of(draft, pair.target).startswith("draft fc takes 96-wide features but this target gives 192")


def test_vocab_mismatch(pair, draft):
    edit_config(draft, vocab_size=32000)
    assert error_of(draft, pair.target) == (
        "draft vocab_size 32000 does not match the target's 256: the draft was made for another model; "
        "use a draft trained for this target"
    )


def test_d2t_out_of_range(pair, draft):
    d2t = torch.zeros(200, dtype=torch.int64)
    d2t[150] = 106 + 1  # draft id 150 -> target id 257
    rewrite_tensors(draft, {"d2t": d2t})
    message = error_of(draft, pair.target)
    assert message.startswith("draft d2t maps draft id 150 to target id 257, outside the target vocabulary [0, 256)")
    assert message.endswith("use a draft trained for this target")


def test_layer_id_out_of_range(pair, draft):
    edit_config(draft, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 29, 57]})  # a 61-layer target's ids
    assert error_of(draft, pair.target) == (
        "draft eagle_aux_hidden_state_layer_ids [1, 29, 57] name the output of layer 29, which feeds layer 30, "
        "but the target has 6 layers (valid ids -1..4); use a draft trained for this target"
    )


def test_hidden_size_mismatch(pair, tmp_path):
    make_draft(tmp_path / "narrow", pair.target, hidden_size=32, intermediate_size=64)
    assert error_of(tmp_path / "narrow", pair.target) == (
        "draft hidden_size 32 differs from the target's 64 and the draft has no embed_tokens.weight of its own "
        "(the head reuses the target's token embedding); use a draft trained for this target"
    )
    # With its own embedding the narrower head is fine.
    rewrite_tensors(tmp_path / "narrow", {"embed_tokens.weight": torch.zeros(256, 32)})
    assert validate_draft(DraftConfig.from_dir(tmp_path / "narrow"), pair.target) == (1, 3, 4)


def test_target_hidden_size_mismatch(pair, draft):
    edit_config(draft, target_hidden_size=7168)
    assert error_of(draft, pair.target).startswith("draft target_hidden_size 7168 does not match the target's hidden size 64")


def test_layer_count_other_than_three(pair, draft):
    edit_config(draft, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3]})
    assert error_of(draft, pair.target) == (
        "an EAGLE-3 head reads 3 target layers but the draft's eagle_aux_hidden_state_layer_ids name 2 ([0, 3]); "
        "list three layer ids in the draft config"
    )


def test_default_layers_of_a_small_target_may_repeat(pair, draft):
    edit_config(draft, eagle_config=None)  # 6 layers: [2, 6//2, 6-3] = [2, 3, 3], as the target captures them
    assert validate_draft(DraftConfig.from_dir(draft), pair.target) == pair.target.default_capture_layers() == (2, 3, 3)


def test_capture_override_mismatch(pair):
    assert error_of(pair.draft_dir, pair.target, capture_layers=(2, 3, 4)) == (
        "the target captures layers [2, 3, 4] but the draft was trained on layers [1, 3, 4]; "
        "drop the capture-layer override or use a matching draft"
    )


def test_validation_runs_before_weights_load(pair, draft):
    rewrite_tensors(draft, {"fc.weight": torch.zeros(64, 64), "lm_head.weight": torch.zeros(7, 7)})
    with pytest.raises(CheckpointError, match="EAGLE-1/2"):  # not the lm_head shape error the loader would give
        load_eagle3(draft, pair.embed, target=pair.target)
    with pytest.raises(CheckpointError, match="EAGLE-1/2"):
        Eagle3Drafter.from_dirs(str(draft), str(pair.target_dir), DrafterConfig(kv_pages=8))


@pytest.mark.parametrize(
    "args,flag",
    [
        ((0, 1, 2), "--speculative-num-steps must be >= 1"),
        ((3, 0, 2), "--speculative-eagle-topk must be >= 1"),
        ((3, 1, 1), "--speculative-num-draft-tokens must be >= 2"),
        ((3, 1, 5), "--speculative-eagle-topk 1 drafts a chain of --speculative-num-steps 3 tokens, so --speculative-num-draft-tokens must be <= 4, got 5"),
        ((2, 2, 8), "--speculative-num-draft-tokens 8 exceeds the 6 candidates + root"),
    ],
)
def test_spec_config_errors_name_the_flag(args, flag):
    with pytest.raises(ConfigError) as e:
        SpecConfig(*args)
    assert flag in str(e.value) and "\n" not in str(e.value)
    assert SpecConfig(2, 2, 7).num_candidates == 6 and SpecConfig(6, 4, 16).num_candidates == 84


def test_topk_beyond_what_extend_kept(pair):
    drafter = Eagle3Drafter.from_dirs(str(pair.draft_dir), str(pair.target_dir), DrafterConfig(kv_pages=8, max_topk=2))
    drafter.extend([("r", [1, 2], torch.zeros(2, 192))])
    with pytest.raises(ConfigError, match="--speculative-eagle-topk 3 exceeds the drafter's max_topk 2"):
        drafter.draft(["r"], SpecConfig(2, 3, 4))
