"""Tree drafting: shape and score properties over many (steps, topk, num_draft_tokens), an independent
tree builder on the dense reference (SGLang's selection rule), and scratch KV that leaves no trace."""

from __future__ import annotations

import random

import pytest
import torch

from draft_checkpoints import DenseEagle3, draft_inputs, pair_drafter
from tandem.speculative.spec_config import SpecConfig

TOL = 1e-4


@pytest.fixture(scope="module")
def ref(pair):
    return DenseEagle3(pair.draft_dir, pair.embed)


def random_specs(count: int, seed: int = 0):
    rng = random.Random(seed)
    specs = []
    for _ in range(count):
        steps, topk = rng.randint(1, 6), rng.randint(1, 4)
        most = min(16, 1 + SpecConfig(steps, topk, 2).num_candidates)
        specs.append(SpecConfig(steps, topk, rng.randint(2, most)))
    return specs


@pytest.fixture(scope="module")
def extended(pair):
    drafter = pair_drafter(pair)
    seqs = {rid: draft_inputs(seed, n) for rid, seed, n in [("a", 10, 6), ("b", 11, 13), ("c", 12, 3)]}
    drafter.extend([(rid, t, f) for rid, (t, f) in seqs.items()])
    return drafter, seqs


@pytest.mark.parametrize("spec", random_specs(40), ids=lambda s: f"S{s.num_steps}k{s.topk}n{s.num_draft_tokens}")
def test_tree_properties(extended, spec):
    drafter, seqs = extended
    free = drafter.allocator.num_free
    lengths = {rid: drafter.num_tokens(rid) for rid in seqs}
    trees = drafter.draft(list(seqs), spec)
    for rid, tree in zip(seqs, trees):
        assert tree.size == spec.num_draft_tokens and tree.tokens[0] == seqs[rid][0][-1]
        assert all(0 <= p < i for i, p in enumerate(tree.parents[1:], start=1))  # parents first
        assert all(tree.scores[i] <= tree.scores[p] for i, p in enumerate(tree.parents[1:], start=1))
        assert max(tree.depths) <= spec.num_steps
        assert all(len(set(tree.tokens[c] for c in tree.children(n))) == len(tree.children(n)) for n in range(tree.size))
        if spec.topk == 1:
            assert tree.parents == list(range(-1, tree.size - 1))
    # Scratch KV is gone: committed lengths and free pages as before; a second draft is identical.
    assert drafter.allocator.num_free == free
    assert {rid: drafter.num_tokens(rid) for rid in seqs} == lengths
    assert drafter.draft(list(seqs), spec) == trees


def reference_tree(ref: DenseEagle3, tokens, feats, spec: SpecConfig):
    """SGLang's rule on the dense reference: (tokens, parents, scores) of the kept nodes."""
    k = spec.topk
    cands = []  # (score, target token, parent candidate index, path of target tokens)

    def children(path, base_score, parent):
        logp = ref.path_logprobs(tokens, feats, path)[-1]
        top = logp.topk(k)
        return [(base_score + float(v), int(ref.to_target[i]), parent, path + [int(ref.to_target[i])])
                for v, i in zip(top.values, top.indices)]

    frontier = list(range(k))
    cands += children([], 0.0, -1)
    for step in range(2, spec.num_steps + 1):
        new = [c for j in frontier for c in children(cands[j][3], cands[j][0], j)]
        base = len(cands)
        cands += new
        order = sorted(range(len(new)), key=lambda i: -new[i][0])  # stable: ties keep the lower index
        frontier = [base + i for i in order[:k]]
    keep = sorted(sorted(range(len(cands)), key=lambda i: -cands[i][0])[: spec.num_draft_tokens - 1])
    node = {c: n + 1 for n, c in enumerate(keep)}
    return ([cands[c][1] for c in keep], [0 if cands[c][2] < 0 else node[cands[c][2]] for c in keep],
            [cands[c][0] for c in keep])


@pytest.mark.parametrize("steps,topk,ndt", [(1, 1, 2), (3, 1, 4), (1, 4, 3), (2, 2, 6), (4, 3, 10), (6, 4, 16), (3, 4, 16), (5, 2, 9)])
def test_tree_matches_reference_builder(extended, ref, steps, topk, ndt):
    """Every kept node is among the top by score of all candidates, and each node's score is the
    dense reference run along its root path (so a node saw exactly its ancestors)."""
    drafter, seqs = extended
    spec = SpecConfig(steps, topk, ndt)
    for rid, tree in zip(seqs, drafter.draft(list(seqs), spec)):
        want_tokens, want_parents, want_scores = reference_tree(ref, *seqs[rid], spec)
        assert tree.tokens[1:] == want_tokens
        assert tree.parents[1:] == want_parents
        assert tree.scores[1:] == pytest.approx(want_scores, abs=TOL)


def test_drafting_leaves_later_results_unchanged(pair):
    """Draft (writing scratch KV) between extends: the extends' outputs equal a drafter that never drafted."""
    a, b = pair_drafter(pair), pair_drafter(pair)
    tokens, feats = draft_inputs(20, 12)
    for d in (a, b):
        d.extend([("r", tokens[:8], feats[:8])])
    a.draft(["r"], SpecConfig(6, 4, 16))
    a.draft(["r"], SpecConfig(3, 2, 5))
    out_a = a.extend([("r", tokens[8:], feats[8:])], return_logits=True)
    out_b = b.extend([("r", tokens[8:], feats[8:])], return_logits=True)
    assert torch.equal(out_a[0][1], out_b[0][1])
    assert a.draft(["r"], SpecConfig(4, 3, 10)) == b.draft(["r"], SpecConfig(4, 3, 10))


def test_batched_drafting_equals_drafting_alone(extended, pair):
    drafter, seqs = extended
    spec = SpecConfig(4, 3, 12)
    together = drafter.draft(list(seqs), spec)
    for rid, tree in zip(seqs, together):
        alone = drafter.draft([rid], spec)[0]
        assert alone.tokens == tree.tokens and alone.parents == tree.parents
        assert alone.scores == pytest.approx(tree.scores, abs=1e-5)


def test_release_frees_pages_and_forgets_the_request(pair):
    drafter = pair_drafter(pair)
    free = drafter.allocator.num_free
    drafter.extend([("r", *draft_inputs(30, 10))])
    assert drafter.allocator.num_free < free
    drafter.release("r")
    drafter.release("r")  # idempotent
    assert drafter.allocator.num_free == free and not drafter.has("r")
    with pytest.raises(KeyError, match="unknown request 'r'"):
        drafter.draft(["r"], SpecConfig(2, 1, 2))
