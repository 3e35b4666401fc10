"""BENCHMARK INSTRUMENT — controlled-acceptance proposer (docs/architecture.md, "The controlled-acceptance
instrument"). Never a serving default.

Random draft weights accept almost nothing, so the speed of the speculative *mechanism* is measured
at an acceptance rate the experiment sets. This wrapper runs the real drafter — the same extend and
draft forwards, the same tree shape and scores — and then rewrites the tokens of the tree's
best-scoring path (from the root, always the highest-scoring child) with the target's own greedy
continuation of the prompt, computed beforehand. Each position of that continuation is corrupted
with probability ``r`` into a different token, drawn once per request (seeded) when the reference is
set: a round sees the flags up to its first corrupted node, whose position the target's bonus then
fills, and the next round starts after it, so every flag decides at most one node and the nodes a
round sees are independent draws. The head's other children are kept but made distinct from the
reference token, so under greedy verification exactly the leading uncorrupted run of the path is
accepted: a chain of ``num_steps`` S has expected accept length (bonus included)
``1 + sum_{d=1..S} (1 - r)^d``. The steered path is renumbered to nodes 1..D (the tree is the same),
so that its accepted nodes sit where a chain's would.

Because the corruption belongs to positions, not to rounds, chains queued on the device
(tandem.speculative.chain_rounds) are steered there to the same tokens (``steer_on_device``): the
same acceptance, round for round, as one round per step.

Only meaningful with greedy verification of the target whose greedy continuation was given;
numbers it produces must be labelled "controlled acceptance".
"""

from __future__ import annotations

import random
import zlib

import torch

from tandem.errors import ConfigError
from tandem.speculative.drafter import Eagle3Drafter
from tandem.speculative.spec_config import SpecConfig
from tandem.speculative.proposer import Proposer
from tandem.speculative.tree import DraftTree


PATTERN_DRAWS = 16  # with a chain's depth given: corruption patterns drawn, the one nearest the expectation kept


def expected_accept_length(corruption_rate: float, depth: int) -> float:
    """Mean tokens per round (accepted drafts + bonus) for a path of ``depth`` draft tokens."""
    return 1.0 + sum((1.0 - corruption_rate) ** d for d in range(1, depth + 1))


def chain_accept_length(proposed: list[int], truth: list[int], depth: int) -> float | None:
    """The mean tokens per round chains of ``depth`` drafts make along ``truth`` when they propose ``proposed``
    (position 0: the first round's root), one round after another; None where no round fits."""
    start, rounds, tokens = 0, 0, 0
    while start + depth < len(truth):
        accepted = 0
        while accepted < depth and proposed[start + accepted + 1] == truth[start + accepted + 1]:
            accepted += 1
        rounds, tokens, start = rounds + 1, tokens + accepted + 1, start + accepted + 1
    return tokens / rounds if rounds else None


class ControlledAcceptanceProposer(Proposer):
    caches_prefixes = True  # attach_prefix (tandem.prefix_cache)

    def __init__(self, drafter: Eagle3Drafter, corruption_rate: float, seed: int = 0):
        if not 0.0 <= corruption_rate <= 1.0:
            raise ConfigError(f"corruption rate must be in [0, 1], got {corruption_rate}")
        self.drafter, self.rate, self.seed = drafter, corruption_rate, seed
        self.vocab_size = drafter.head.config.vocab_size
        # rid -> (prompt length, reference, the proposed token per reference position, generator)
        self._refs: dict[str, tuple[int, list[int], list[int], random.Random]] = {}
        self._device_table: tuple[tuple[str, ...], torch.Tensor, torch.Tensor] | None = None

    def set_reference(self, rid: str, prompt_len: int, continuation: list[int], depth: int | None = None) -> None:
        """``continuation``: the target's greedy tokens after the prompt (its first is the prefill's sample).
        ``depth``: the drafts of the chain the run drafts, where known: of PATTERN_DRAWS corruption patterns, the one
        whose accept length for such chains along the continuation is nearest the rate's expectation is kept, so that
        a short run (one request of a few hundred tokens) reaches its goal, not the goal give or take a draw's spread."""
        # A per-request generator: the corruption pattern does not depend on what else is batched.
        rng = random.Random((self.seed * 1_000_003) ^ zlib.crc32(rid.encode()))

        def pattern() -> list[int]:
            return [self._other(rng, {truth}) if rng.random() < self.rate else truth for truth in continuation]

        proposed = pattern()
        if depth and 0.0 < self.rate < 1.0:
            goal = expected_accept_length(self.rate, depth)

            def miss(candidate: list[int]) -> float:
                reached = chain_accept_length(candidate, continuation, depth)
                return abs(reached - goal) if reached is not None else 0.0

            proposed = min([proposed] + [pattern() for _ in range(PATTERN_DRAWS - 1)], key=miss)
        self._refs[rid] = (prompt_len, list(continuation), proposed, rng)
        self._device_table = None

    def generated(self, rid: str) -> int:
        """Tokens generated so far: the prefill extend passes x_1..x_n (its last is generated token 1),
        every later extend passes only generated tokens."""
        prompt_len = self._refs[rid][0]
        return self.drafter.num_tokens(rid) - prompt_len + 1

    @property
    def rounds_drafter(self) -> Eagle3Drafter:
        """The drafter whose chain rounds can be queued on the device (steered by ``steer_on_device``)."""
        return self.drafter

    # -- the drafter's API, passed through ---------------------------------------------------------
    def extend(self, items: list[tuple[str, list[int], torch.Tensor]], return_logits: bool = False):
        return self.drafter.extend(items, return_logits)

    def attach_prefix(self, rid: str, tokens: list[int]) -> int:
        return self.drafter.attach_prefix(rid, tokens)

    def release(self, rid: str) -> None:
        self.drafter.release(rid)
        self._refs.pop(rid, None)
        self._device_table = None

    def release_device(self) -> None:
        self.drafter.release_device()

    def draft(self, rids: list[str], spec: SpecConfig) -> list[DraftTree]:
        trees = self.drafter.draft(rids, spec)  # the real head runs; only tokens are rewritten
        return [self._steer(rid, tree) if rid in self._refs else tree for rid, tree in zip(rids, trees)]

    # -- rewriting -------------------------------------------------------------------------------
    def _steer(self, rid: str, tree: DraftTree) -> DraftTree:
        _, ref, proposed, rng = self._refs[rid]
        start = self.generated(rid) - 1  # ref[start] is the root when the request is on track
        tokens = list(tree.tokens)
        children: list[list[int]] = [[] for _ in range(tree.size)]
        for i in range(1, tree.size):
            children[tree.parents[i]].append(i)
        # The path to steer: down the deepest subtree (ties: the better-scored, then the earlier node), so
        # that at corruption 0 a pruned tree still accepts its full depth, as a chain does.
        height = [0] * tree.size
        for i in range(tree.size - 1, 0, -1):  # parents precede children
            height[tree.parents[i]] = max(height[tree.parents[i]], height[i] + 1)
        node, depth, path = 0, 0, []
        while children[node]:
            depth += 1
            # (a chain's only child needs no choice; its scores may still be on the device)
            best = children[node][0] if len(children[node]) == 1 else max(
                children[node], key=lambda c: (height[c], tree.scores[c], -c))
            if start + depth >= len(ref):
                break  # past the reference: leave the head's own tokens
            truth = ref[start + depth]
            siblings = [c for c in children[node] if c != best]
            tokens[best] = proposed[start + depth]
            if tokens[best] != truth and tokens[best] in {tokens[s] for s in siblings}:
                tokens[best] = self._other(rng, {truth, *(tokens[s] for s in siblings)})
            taken = {truth, tokens[best]}
            for s in siblings:  # a sibling equal to the truth would be accepted in the path's place
                if tokens[s] in taken:
                    tokens[s] = self._other(rng, taken | {tokens[o] for o in siblings})
                taken.add(tokens[s])
            node = best
            path.append(best)
        return self._path_first(DraftTree(tokens, list(tree.parents), list(tree.scores), tree.pending), path)

    def steer_on_device(self, rids: list[str], tokens: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
        """``_steer`` for chains whose tokens stay on the device: ``tokens`` [n, nd] (root first),
        ``roots`` [n] each root's index in its sequence → the chains with the reference's proposed
        tokens in place of the head's (the head's own past the reference, or for requests without one)."""
        key = tuple(rids)
        if self._device_table is None or self._device_table[0] != key:
            longest = max([len(self._refs[r][2]) for r in rids if r in self._refs], default=1)
            table = torch.full((len(rids), longest), -1, dtype=torch.int64)  # -1: keep the head's token
            prompt_lens = torch.zeros(len(rids), dtype=torch.int64)
            for i, rid in enumerate(rids):
                if rid in self._refs:
                    prompt_lens[i], proposed = self._refs[rid][0], self._refs[rid][2]
                    table[i, : len(proposed)] = torch.tensor(proposed)
            self._device_table = (key, table.to(tokens.device), prompt_lens.to(tokens.device))
        _, table, prompt_lens = self._device_table
        depth = torch.arange(1, tokens.shape[1], device=tokens.device)
        index = (roots - prompt_lens)[:, None] + depth  # [n, nd - 1] reference index of each draft node
        steered = table.gather(1, index.clamp(0, table.shape[1] - 1))
        steered = torch.where((index >= 0) & (index < table.shape[1]), steered, -1)
        return torch.cat([tokens[:, :1], torch.where(steered >= 0, steered, tokens[:, 1:])], dim=1)

    @staticmethod
    def _path_first(tree: DraftTree, path: list[int]) -> DraftTree:
        """The same tree with the steered path renumbered 1..D (the rest after it, in order). An
        accepted path then sits where a chain's does — its KV at the committed length + 1..D, attending
        to contiguous keys — so in bf16 on the GPU it rounds exactly as the reference run did; elsewhere
        in the tree it could round differently and flip the target's near-ties (docs/benchmarks.md)."""
        if tree.pending is not None or path == list(range(1, len(path) + 1)):
            return tree  # a chain is in path order already (and its tokens may still be on the device)
        on_path = set(path)
        order = [0, *path, *(i for i in range(1, tree.size) if i not in on_path)]
        new = {old: i for i, old in enumerate(order)}
        return DraftTree([tree.tokens[o] for o in order], [-1] + [new[tree.parents[o]] for o in order[1:]],
                         [tree.scores[o] for o in order] if tree.scores else [])

    def _other(self, rng: random.Random, excluded: set[int]) -> int:
        if len(excluded) >= self.vocab_size:
            raise ConfigError(f"vocabulary of {self.vocab_size} is too small to corrupt a tree this wide")
        while True:
            t = rng.randrange(self.vocab_size)
            if t not in excluded:
                return t
