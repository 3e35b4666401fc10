"""Verification of draft trees inside the engine's round: the verify chunk, acceptance, KV compaction.

The tree (root = the request's newest token, not yet in the KV cache) is appended after the
committed tokens in one chunk: node i goes to KV index ``committed + i``, at rotary position
``committed + depth(i)``, attending to the prefix and its own ancestors. After acceptance the
accepted path is moved to ``committed + 1, 2, ...`` so the sequence's KV is contiguous again.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.engine.batch import SequenceChunk
from tandem.engine.request import Request
from tandem.sampling import SamplingParams, adjusted_probs
from tandem.speculative.accept import AcceptResult, accept_greedy, accept_sampling
from tandem.speculative.tree import DraftTree


class ProposerUnavailable(RuntimeError):
    """The drafter cannot answer (absent, past its deadline, dead). Its state for every request is
    considered lost; the engine carries on without speculation."""


class Proposer(Protocol):
    """What the engine needs from a drafter (in process, or a client of the drafter service).

    A remote proposer may also expose ``available: bool``; while it is False the engine neither
    captures features for it nor drafts; and ``discard(reason)``, which the engine calls when a tree
    it returned is unusable (its drafter state is then dropped as after a loss)."""

    def extend(self, items: list[tuple[str, list[int], torch.Tensor]]) -> None:
        """Per request: new tokens and the target features of the tokens before them (same count)."""

    def draft(self, rids: list[str], spec) -> list[DraftTree]:
        """One tree per request, rooted at the last token given to ``extend``."""

    def release(self, rid: str) -> None:
        """Forget a request (finished, aborted or preempted)."""


def verify_chunk(req: Request, tree: DraftTree) -> SequenceChunk:
    committed = req.num_tokens - 1
    if tree.size == 1:
        return SequenceChunk([tree.tokens[0]], committed, req.kv.page_table())
    return SequenceChunk(
        token_ids=list(tree.tokens),
        prefix_len=committed,
        pages=req.kv.page_table(),
        positions=[committed + d for d in tree.depths],
        tree_mask=tree.ancestor_mask(),
        logits="all",
        device_ids=tree.pending.ids if tree.pending is not None else None,
    )


def accept_tree(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> AcceptResult:
    """Accept against the target's logits at every node ([tree.size, V]), greedily or by rejection sampling."""
    if params.greedy:
        return accept_greedy(tree, logits.argmax(dim=-1).tolist())
    probs = adjusted_probs(logits, [params] * tree.size)
    return accept_sampling(tree, probs, generator)


def compaction_moves(req: Request, accepted_nodes: list[int]) -> tuple[list[int], list[int]]:
    """Flat KV slots to copy so accepted node k (tree index n) lands at committed + k."""
    committed = req.num_tokens - 1
    src, dst = [], []
    for k, node in enumerate(accepted_nodes, start=1):
        if node != k:
            src.append(req.kv.slot(committed + node))
            dst.append(req.kv.slot(committed + k))
    return src, dst
