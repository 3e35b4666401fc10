"""Tests of the accept step against independent references.

Greedy: a direct simulation of target-only greedy decoding over random trees. Sampling: the exact
joint distribution of the first tokens, computed by enumeration from a fixed "true" next-token table
keyed by the token path, compared with the empirical joint of many accept rounds (chi-square).
"""

from __future__ import annotations

import functools
import itertools
import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tandem.sampling import SamplingParams, adjusted_probs, sample_from_probs
from tandem.speculative.accept import AcceptResult, accept_greedy, accept_sampling
from tandem.speculative.tree import DraftTree

# ---------------------------------------------------------------------------------------------- greedy


def random_tree(rng: random.Random, vocab: int, max_nodes: int, distinct_siblings: bool = True) -> DraftTree:
    tokens, parents = [rng.randrange(vocab)], [-1]
    for _ in range(1, rng.randint(1, max_nodes)):
        i = len(tokens)
        parent = rng.randrange(i)
        used = {tokens[c] for c in range(i) if parents[c] == parent}
        free = [t for t in range(vocab) if t not in used] if distinct_siblings else list(range(vocab))
        if not free:
            continue
        tokens.append(rng.choice(free))
        parents.append(parent)
    return DraftTree(tokens, parents)


def greedy_reference(tree: DraftTree, argmax: list[int]) -> list[int]:
    """Target-only greedy decoding, moving through the tree only to know where the target is."""
    out, node = [], 0
    while True:
        token = argmax[node]
        out.append(token)
        nxt = [c for c in range(tree.size) if tree.parents[c] == node and tree.tokens[c] == token]
        if not nxt:
            return out
        node = nxt[0]


def check_consistent(tree: DraftTree, res: AcceptResult) -> None:
    assert len(res.tokens) == len(res.accepted_nodes) + 1 == res.accept_length
    assert res.tokens[-1] == res.bonus_token
    parent = 0
    for node, token in zip(res.accepted_nodes, res.tokens):
        assert tree.parents[node] == parent and tree.tokens[node] == token
        parent = node


@pytest.mark.parametrize("distinct", [True, False])
def test_greedy_matches_target_only_decoding(distinct: bool) -> None:
    rng = random.Random(1234 + distinct)
    for _ in range(3000):
        tree = random_tree(rng, vocab=5, max_nodes=12, distinct_siblings=distinct)
        # Bias argmax toward drafted tokens so long accepted paths are common, not just the bonus.
        argmax = []
        for node in range(tree.size):
            kids = [tree.tokens[c] for c in tree.children(node)]
            argmax.append(rng.choice(kids) if kids and rng.random() < 0.7 else rng.randrange(5))
        as_tensor = rng.random() < 0.5
        res = accept_greedy(tree, torch.tensor(argmax) if as_tensor else argmax)
        check_consistent(tree, res)
        assert res.tokens == greedy_reference(tree, argmax)


def test_greedy_chain_all_match_and_none_match() -> None:
    tree = DraftTree.chain(7, [3, 1, 4, 1])
    res = accept_greedy(tree, [3, 1, 4, 1, 5])
    assert res.accepted_nodes == [1, 2, 3, 4] and res.tokens == [3, 1, 4, 1, 5] and res.bonus_token == 5
    tree = DraftTree([7, 2, 3, 4], [-1, 0, 0, 1])
    res = accept_greedy(tree, [9, 4, 0, 0])
    assert res.accepted_nodes == [] and res.tokens == [9] and res.bonus_token == 9
    assert accept_greedy(DraftTree([5], [-1]), [8]).tokens == [8]


def test_greedy_rejects_wrong_length() -> None:
    with pytest.raises(ValueError):
        accept_greedy(DraftTree.chain(0, [1]), [1])


# -------------------------------------------------------------------------------------------- sampling

V = 6


@functools.lru_cache(maxsize=None)
def true_probs(path: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
    """P(next | path) after the request's adjustments: a fixed function of the path (context-consistent)."""
    seed = 1 + sum((t + 1) * (V + 1) ** i for i, t in enumerate(path))
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed))
    return adjusted_probs(logits.unsqueeze(0), [params])[0].double()


def exact_joint(root: int, n: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(V), repeat=n):
        prob = 1.0
        for i in range(n):
            prob *= float(true_probs((root, *seq[:i]), params)[seq[i]])
        joint[seq] = prob
    return joint


# A tree shape: each child is (rank of its token in the target distribution at its parent, subtree).
# Rank V-1 is the least likely token (probability 0 under top-k/top-p), tried first so that it must be
# rejected; the most likely token (rank 0) is often not the first child, so renormalisation matters.
SHAPE = [(V - 1, []), (1, [(0, [(1, [])]), (2, [])]), (0, [(1, [(0, [])]), (0, [(0, [])])]), (3, [])]


def build_tree(root: int, params: SamplingParams, shape: list) -> tuple[DraftTree, torch.Tensor]:
    tokens, parents, paths = [root], [-1], [(root,)]

    def add(node: int, children: list) -> None:
        order = torch.argsort(true_probs(paths[node], params), descending=True, stable=True).tolist()
        for rank, sub in children:
            tokens.append(order[rank])
            parents.append(node)
            paths.append(paths[node] + (order[rank],))
            add(len(tokens) - 1, sub)

    add(0, shape)
    probs = torch.stack([true_probs(p, params) for p in paths]).float()
    return DraftTree(tokens, parents), probs


def run_rounds(accept_fn, tree: DraftTree, probs: torch.Tensor, params: SamplingParams, n: int, trials: int, seed: int):
    """``trials`` rounds, each with fresh uniforms (one per depth, as the engine draws them), completed to ``n``
    tokens by draws from the true distribution → counts of the ``n``-token sequences."""
    rng = np.random.default_rng(seed)
    root, counts, depth = tree.tokens[0], {}, max(tree.depths)
    for _ in range(trials):
        res = accept_fn(tree, probs, rng.random(depth + 1).tolist())
        for node, token in zip([0, *res.accepted_nodes], res.tokens):  # never a zero-probability token
            assert float(probs[node, token]) > 0.0
        seq = list(res.tokens[:n])
        while len(seq) < n:  # what the next round would emit first: a draw from the true distribution
            p = true_probs((root, *seq), params).numpy()
            seq.append(int(rng.choice(V, p=p / p.sum())))
        counts[tuple(seq)] = counts.get(tuple(seq), 0) + 1
    return counts


def chi_square_pvalue(counts: dict, joint: dict, trials: int) -> float:
    impossible = {s: c for s, c in counts.items() if joint.get(s, 0.0) == 0.0}
    assert not impossible, f"emitted sequences the target gives probability 0: {impossible}"
    obs, exp, rest_obs, rest_exp = [], [], 0, 0.0
    for seq, prob in joint.items():
        if prob * trials >= 5:
            obs.append(counts.get(seq, 0))
            exp.append(prob * trials)
        else:  # pool rare cells so the chi-square approximation holds
            rest_obs += counts.get(seq, 0)
            rest_exp += prob * trials
    if rest_exp > 0:
        obs.append(rest_obs)
        exp.append(rest_exp)
    if len(obs) < 2:
        return 1.0  # a single possible outcome: the impossibility check above is the whole test
    exp = np.array(exp) * (trials / sum(exp))  # remove float drift in the total
    return float(chisquare(obs, exp).pvalue)


def marginal(counts: dict, n: int) -> dict:
    out: dict = {}
    for seq, c in counts.items():
        out[seq[:n]] = out.get(seq[:n], 0) + c
    return out


CASES = {
    "plain": SamplingParams(temperature=1.0),
    "top_k": SamplingParams(temperature=0.7, top_k=3),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
    "near_greedy": SamplingParams(temperature=0.05),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sampling_is_lossless(name: str) -> None:
    params, trials, root = CASES[name], 20_000, 1
    tree, probs = build_tree(root, params, SHAPE)
    counts = run_rounds(accept_sampling, tree, probs, params, n=3, trials=trials, seed=11)
    for n in (1, 2, 3):
        pvalue = chi_square_pvalue(marginal(counts, n), exact_joint(root, n, params), trials)
        assert pvalue > 1e-3, f"{name}: first {n} tokens differ from the target's distribution (p={pvalue:.2e})"


def test_top_k_case_drafts_zero_probability_tokens() -> None:
    # Guard on the test itself: the filtered cases must actually put zero-probability tokens in the tree.
    for name in ("top_k", "top_p"):
        tree, probs = build_tree(1, CASES[name], SHAPE)
        assert any(float(probs[tree.parents[i], tree.tokens[i]]) == 0.0 for i in range(1, tree.size))


def _accept_without_renormalising(tree: DraftTree, probs: torch.Tensor, uniforms: list[float]) -> AcceptResult:
    """A plausible-looking but biased rule (accept with p(x), not p(x)/remaining) the test must catch."""
    gen = torch.Generator().manual_seed(int(uniforms[0] * 2**53))  # (a draw per sibling tried: its own stream)
    accepted, node = [], 0
    while True:
        p = probs[node].double()
        residual = p.clone()
        for child in tree.children(node):
            if float(torch.rand(1, generator=gen)) < float(p[tree.tokens[child]]):
                accepted.append(child)
                node = child
                break
            residual[tree.tokens[child]] = 0.0
        else:
            bonus = int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
            return AcceptResult(accepted, [tree.tokens[n] for n in accepted] + [bonus], bonus)


def test_chi_square_harness_detects_a_biased_acceptor() -> None:
    params, trials = CASES["plain"], 10_000
    tree, probs = build_tree(2, params, SHAPE)
    counts = run_rounds(_accept_without_renormalising, tree, probs, params, n=2, trials=trials, seed=5)
    assert chi_square_pvalue(counts, exact_joint(2, 2, params), trials) < 1e-3


def test_root_only_tree_samples_bonus_from_root() -> None:
    params, trials = CASES["top_p"], 20_000
    tree, probs = build_tree(4, params, [])
    counts = run_rounds(accept_sampling, tree, probs, params, n=1, trials=trials, seed=3)
    assert chi_square_pvalue(counts, exact_joint(4, 1, params), trials) > 1e-3


def test_duplicate_sibling_tokens() -> None:
    params, trials, root = CASES["plain"], 10_000, 1
    # Root children: rank 1, rank 1 again (a duplicate), rank 0; the duplicate's subtree must never be used.
    tree, probs = build_tree(root, params, [(1, [(0, [])]), (1, [(0, [])]), (0, [(0, [])])])
    assert tree.tokens[1] == tree.tokens[3] and tree.parents[3] == 0
    rng, seen = np.random.default_rng(9), set()
    for _ in range(2_000):
        seen.update(accept_sampling(tree, probs, rng.random(3).tolist()).accepted_nodes)
    assert 3 not in seen and 4 not in seen and {1, 5} <= seen
    counts = run_rounds(accept_sampling, tree, probs, params, n=2, trials=trials, seed=21)
    assert chi_square_pvalue(counts, exact_joint(root, 2, params), trials) > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_with_the_same_uniforms_the_tokens_are_target_only_samplings(name: str) -> None:
    """What a round emits is what target-only sampling emits with the same uniforms (one per token, by its
    place in the sequence): token after token drawn from the target's distribution after the ones before —
    so a seeded request's text does not depend on whether its steps speculate."""
    params, rng = CASES[name], np.random.default_rng(17)
    tree, probs = build_tree(2, params, SHAPE)
    for _ in range(300):
        u = rng.random(max(tree.depths) + 1).astype(np.float32).tolist()
        got = accept_sampling(tree, probs, u).tokens
        plain: list[int] = []
        for k in range(len(got)):  # target-only: one token per step, from the distribution after the ones before
            p = true_probs((2, *plain), params).float()
            plain.append(int(sample_from_probs(p.unsqueeze(0), torch.tensor([u[k]]))[0]))
        assert got == plain


def test_one_hot_probs_reduce_to_greedy() -> None:
    # Greedy requests' adjusted distribution is one-hot: sampling acceptance must then act greedily.
    rng = random.Random(7)
    for _ in range(300):
        tree = random_tree(rng, vocab=5, max_nodes=10)
        argmax = [rng.choice([tree.tokens[c] for c in tree.children(i)] or [rng.randrange(5)]) for i in range(tree.size)]
        probs = torch.nn.functional.one_hot(torch.tensor(argmax), 5).float()
        u = [rng.random() for _ in range(max(tree.depths) + 1)]
        assert accept_sampling(tree, probs, u).tokens == accept_greedy(tree, argmax).tokens


def test_sampling_rejects_bad_inputs() -> None:
    tree = DraftTree.chain(0, [1])
    with pytest.raises(ValueError):
        accept_sampling(tree, torch.full((1, 4), 0.25), [0.5, 0.5])
    with pytest.raises(ValueError):
        accept_sampling(tree, torch.zeros(2, 4), [0.5, 0.5])
    with pytest.raises(ValueError):
        accept_sampling(tree, torch.full((2, 4), 0.25), [0.5])  # one uniform for two depths
