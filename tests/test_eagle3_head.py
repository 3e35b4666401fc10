"""The EAGLE-3 head and drafter against the dense reference in tests/draft_checkpoints.py: paged,
batched, multi-call extend and multi-step chain drafting give the reference's states and logits."""

from __future__ import annotations

import pytest
import torch

from draft_checkpoints import DenseEagle3, draft_inputs, pair_drafter
from tandem.forward_batch import ForwardBatch, SequenceChunk
from tandem.engine.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.kv_cache import PageAllocator, SequenceKV
from tandem.models.eagle3_checkpoint import load_eagle3
from tandem.speculative.drafter import Eagle3Drafter
from tandem.speculative.spec_config import SpecConfig

TOL = 1e-4


@pytest.fixture(scope="module")
def ref(pair):
    return DenseEagle3(pair.draft_dir, pair.embed)


def make_drafter(pair) -> Eagle3Drafter:
    return pair_drafter(pair, kv_pages=256, page_shuffle_seed=7)


def test_extend_matches_dense_reference(pair, ref):
    drafter = make_drafter(pair)
    seqs = {rid: draft_inputs(seed, n) for rid, seed, n in [("a", 1, 11), ("b", 2, 5), ("c", 3, 17)]}
    # Two calls per request (a prefill, then a round's accepted tokens), different lengths, one forward each.
    cuts = {"a": 7, "b": 1, "c": 16}
    first = drafter.extend([(r, t[: cuts[r]], f[: cuts[r]]) for r, (t, f) in seqs.items()], return_logits=True)
    second = drafter.extend([(r, t[cuts[r]:], f[cuts[r]:]) for r, (t, f) in seqs.items()], return_logits=True)
    for (rid, (tokens, feats)), one, two in zip(seqs.items(), first, second):
        states, logits = ref.run(tokens, ref.project(feats))
        assert drafter.num_tokens(rid) == len(tokens)
        got_states = torch.cat([one[0], two[0]]).double()
        got_logits = torch.cat([one[1], two[1]]).double()
        assert torch.allclose(got_states, states, atol=TOL), (got_states - states).abs().max()
        assert torch.allclose(got_logits, logits, atol=TOL), (got_logits - logits).abs().max()


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_chain_draft_matches_dense_reference(pair, ref, steps):
    drafter = make_drafter(pair)
    tokens, feats = draft_inputs(4, 9)
    other_tokens, other_feats = draft_inputs(5, 4)
    drafter.extend([("a", tokens, feats), ("b", other_tokens, other_feats)])
    tree = drafter.draft(["b", "a"], SpecConfig(steps, 1, steps + 1))[1]
    assert tree.parents == list(range(-1, steps)) and tree.tokens[0] == tokens[-1]
    # The reference: greedy along its own argmax, feeding back the previous row's state.
    path, score = [], 0.0
    for d in range(steps):
        logp = ref.path_logprobs(tokens, feats, path)[-1]
        best = int(logp.argmax())
        path.append(int(ref.to_target[best]))
        score += float(logp[best])
        assert tree.scores[d + 1] == pytest.approx(score, abs=TOL)
    assert tree.tokens[1:] == path


def test_head_shares_the_target_embedding(pair):
    embed = pair.embed.clone()
    head = load_eagle3(pair.draft_dir, embed)
    assert head.embed_weight.data_ptr() == embed.data_ptr()
    assert "embed_tokens.weight" not in dict(head.named_parameters())


def test_head_rejects_an_input_of_the_wrong_width(pair):
    drafter = make_drafter(pair)
    with pytest.raises(ValueError, match="need features of shape"):
        drafter.extend([("a", [1, 2], torch.zeros(2, 64))])
    assert not drafter.has("a") and drafter.allocator.num_free == drafter.allocator.capacity_pages


def test_target_capture_feeds_the_draft_layers_it_names(pair, ref):
    """The draft names outputs of layers 0, 2, 3; the target engine captures inputs of 1, 3, 4:
    the same tensors as HF's hidden_states[k + 1]. Those features drive the drafter end to end."""
    drafter = make_drafter(pair)
    runner = ModelRunner(EngineConfig(model=str(pair.target_dir), capture_layers=drafter.capture_layers, kv_pages=16), pair.target)
    prompt = [5, 17, 99, 3, 250, 42, 8]
    kv = SequenceKV(PageAllocator(16, 16))
    kv.reserve(len(prompt))
    logits, feats = runner.forward(ForwardBatch([SequenceChunk(prompt, 0, kv.pages)], capture_features=True))
    with torch.no_grad():
        hs = pair.hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    expected = torch.cat([hs[k + 1][0] for k in pair.draft.aux_layer_ids], dim=-1)  # [n, 3H]
    assert torch.allclose(feats, expected, atol=1e-4)
    first = int(logits[0].argmax())
    out = drafter.extend([("r", prompt[1:] + [first], feats)], return_logits=True)
    _, want = ref.run(prompt[1:] + [first], ref.project(feats))
    assert torch.allclose(out[0][1].double(), want, atol=TOL)
