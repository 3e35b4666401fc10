"""Verification of draft trees inside the engine's round: the verify chunk, acceptance, KV compaction.

The tree (root = the request's newest token, not yet in the KV cache) is appended after the
committed tokens in one chunk: node i goes to KV index ``committed + i``, at rotary position
``committed + depth(i)``, attending to the prefix and its own ancestors. After acceptance the
accepted path is moved to ``committed + 1, 2, ...`` so the sequence's KV is contiguous again.
"""

from __future__ import annotations

import torch

from tandem.forward_batch import SequenceChunk
from tandem.engine.request import Request
from tandem.sampling import SamplingParams, adjusted_probs, token_uniforms
from tandem.speculative.accept import AcceptResult, accept_greedy, accept_sampling
from tandem.speculative.tree import DraftTree


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


def accept_tree(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, seed: int, root: int) -> AcceptResult:
    """Accept against the target's logits at every node ([tree.size, V]), greedily or by sampling; ``root``: the
    index of the tree's root token in the request's sequence (a sampled token after a depth-d node is ``root + 1 + d``)."""
    if params.greedy:
        return accept_greedy(tree, logits.argmax(dim=-1).tolist())
    probs = adjusted_probs(logits, [params] * tree.size)
    return accept_sampling(tree, probs, token_uniforms([(seed, root + 1)], max(tree.depths) + 1)[:, 0].tolist())


def compaction_moves(req: Request, accepted_nodes: list[int]) -> tuple[list[int], list[int]]:
    """Flat KV slots to copy so accepted node k (tree index n) lands at committed + k."""
    committed = req.num_tokens - 1
    src, dst = [], []
    for k, node in enumerate(accepted_nodes, start=1):
        if node != k:
            src.append(req.kv.slot(committed + node))
            dst.append(req.kv.slot(committed + k))
    return src, dst
