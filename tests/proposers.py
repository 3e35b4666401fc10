"""Proposers that need no draft model, for testing verification on its own.

Whatever a proposer drafts, speculative output must equal target-only output (greedy), so random
trees test losslessness and KV compaction; an oracle that knows the target's continuation tests
that long accepted paths, including ones that are not the first child, are committed correctly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tandem.speculative.policy import PolicyConfig, SpeculationPolicy
from tandem.speculative.proposer import Proposer
from tandem.speculative.tree import DraftTree


@dataclass(frozen=True)
class Spec:
    """What these proposers read of a speculation setting: the tree's size (a tree, not a chain: topk is not 1)."""

    num_draft_tokens: int
    topk: int = 0


def always_speculate() -> SpeculationPolicy:
    """Speculation at every step: tests that compare rounds between runs cannot let the default policy's
    timed explorations (wall-clock dependent) switch a step to plain decoding."""
    return SpeculationPolicy(PolicyConfig(enabled=False))


class CyclingChains(SpeculationPolicy):
    """Speculates at every step, its chain 3, 1, 2, 3, ... drafts decision by decision (what a measured policy does
    when acceptance or costs move, scripted: no clock decides it)."""

    def __init__(self):
        super().__init__(PolicyConfig(enabled=False))
        self.decisions = 0

    def chain_spec(self, batch_size, spec):
        from tandem.speculative.chain_depth import chain_ladder

        self.decisions += 1
        return chain_ladder(spec)[(2, 0, 1)[self.decisions % 3]]


class RandomTreeProposer(Proposer):
    """Random tree shapes and tokens; optionally puts the true continuation somewhere in the tree."""

    def __init__(self, vocab: int, seed: int = 0, oracle: dict[str, list[int]] | None = None,
                 hit_rate: float = 0.7):
        self.vocab, self.rng = vocab, random.Random(seed)
        self.oracle = oracle or {}  # rid -> the target's full greedy token sequence (prompt + output)
        self.hit_rate = hit_rate
        self.tokens: dict[str, list[int]] = {}
        self.feature_rows: dict[str, int] = {}
        self.released: list[str] = []

    def extend(self, items):
        for rid, tokens, features in items:
            assert features.shape[0] == len(tokens), "one feature row per new token"
            self.tokens.setdefault(rid, []).extend(tokens)
            self.feature_rows[rid] = self.feature_rows.get(rid, 0) + features.shape[0]

    def draft(self, rids, spec):
        return [self._tree(rid, spec.num_draft_tokens) for rid in rids]

    def release(self, rid):
        self.released.append(rid)
        self.tokens.pop(rid, None)
        self.feature_rows.pop(rid, None)

    def _tree(self, rid: str, size: int) -> DraftTree:
        root = self.tokens[rid][-1]
        tokens, parents = [root], [-1]
        truth = self.oracle.get(rid)
        # Known continuation after the root, by position in the full sequence; the proposer's token
        # history is prompt[1:] + outputs, so the root is at index len(history) of the full sequence.
        pos = len(self.tokens[rid])
        follow = 0  # the node currently following the true path
        depth_on_path = 0
        for i in range(1, size):
            parent = self.rng.randrange(i)
            on_path = truth is not None and parent == follow and self.rng.random() < self.hit_rate
            if on_path and pos + depth_on_path + 1 < len(truth):
                token = truth[pos + depth_on_path + 1]
                follow, depth_on_path = i, depth_on_path + 1
            else:
                token = self.rng.randrange(self.vocab)
            siblings = {tokens[j] for j in range(1, i) if parents[j] == parent}
            if token in siblings:  # siblings are distinct, as top-k children are
                token = next(t for t in range(self.vocab) if t not in siblings)
            tokens.append(token)
            parents.append(parent)
        return DraftTree(tokens, parents)
