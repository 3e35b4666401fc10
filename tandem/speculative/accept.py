"""Accept step of tree speculative decoding: which drafted nodes the target keeps, plus one bonus token.

Both rules are lossless with respect to the target alone:

* ``accept_greedy`` walks the tree while a child's token equals the target's argmax at the current
  node; the bonus is the target's argmax at the last accepted node. The emitted tokens are exactly
  what target-only greedy decoding would emit.
* ``accept_sampling`` is recursive rejection sampling over siblings for a *deterministic* draft (the
  drafter picks its children by top-k, it does not sample them, so the draft probability of each
  child is effectively 1 and the acceptance test needs only the target distribution). At a node with
  target distribution p, child x_j is accepted with probability p'(x_j), where p' is p with the
  tokens of already-rejected siblings removed and renormalised; if every child is rejected the bonus
  is drawn from that residual. That is the same as drawing the target's token t ~ p and keeping the
  child that carries t (the bonus t when none does) — which is how it is done, with the uniform plain
  decoding would draw for that token, so the emitted tokens are distributed as p at every step and are
  the very tokens target-only sampling gives for the same seed.

``target_probs`` must already be the request's *adjusted* distribution (``tandem.sampling.adjusted_probs``:
temperature, top-k, top-p), so what is accepted and what plain decoding samples are the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tandem.sampling import sample_from_probs
from tandem.speculative.tree import DraftTree


@dataclass
class AcceptResult:
    """What one request keeps from one verified draft tree."""

    accepted_nodes: list[int]  # tree node indices accepted, in path order; the root (node 0) is excluded
    tokens: list[int]  # the accepted nodes' tokens followed by the bonus token
    bonus_token: int  # the target's own token after the last accepted node

    @property
    def accept_length(self) -> int:
        """Tokens emitted this round (accepted drafts + bonus), the τ of the speculative literature."""
        return len(self.tokens)

    @property
    def last_node(self) -> int:
        """The deepest accepted node (0 when nothing was accepted): where the bonus was decided."""
        return self.accepted_nodes[-1] if self.accepted_nodes else 0


def _children_lists(tree: DraftTree) -> list[list[int]]:
    # One pass instead of DraftTree.children per visited node (which scans the whole tree each time).
    children: list[list[int]] = [[] for _ in range(tree.size)]
    for node in range(1, tree.size):
        children[tree.parents[node]].append(node)
    return children


def _result(tree: DraftTree, accepted: list[int], bonus: int) -> AcceptResult:
    return AcceptResult(accepted, [tree.tokens[n] for n in accepted] + [bonus], bonus)


def accept_greedy(tree: DraftTree, target_argmax: Sequence[int] | torch.Tensor) -> AcceptResult:
    """Greedy acceptance: follow the children that match the target's argmax, then add the argmax bonus.

    ``target_argmax[i]`` is the target's argmax next token after node i (from the verify forward).
    Among equal sibling tokens the lowest node index wins, which is harmless: duplicates carry the same
    token and, under a tree attention mask, the same context.
    """
    if isinstance(target_argmax, torch.Tensor):
        target_argmax = target_argmax.tolist()  # one device sync for the whole tree
    if len(target_argmax) != tree.size:
        raise ValueError(f"target_argmax has {len(target_argmax)} entries for a tree of {tree.size} nodes")
    children = _children_lists(tree)
    accepted: list[int] = []
    node = 0
    while True:
        want = int(target_argmax[node])
        match = next((c for c in children[node] if tree.tokens[c] == want), None)
        if match is None:
            return _result(tree, accepted, want)
        accepted.append(match)
        node = match


def accept_sampling(tree: DraftTree, target_probs: torch.Tensor, uniforms: Sequence[float]) -> AcceptResult:
    """Sampling acceptance for a deterministic (top-k) draft: the target's own token after each node, drawn as
    plain decoding draws it (``sample_from_probs`` with the uniform of its place in the sequence), then the
    greedy walk over those tokens.

    ``target_probs`` is ``[tree.size, V]``: row i is the request's adjusted target distribution after node i;
    ``uniforms[d]``: the uniform of the token after a node of depth d (the root's: d = 0), ``token_uniform`` of
    its index. For a draft whose children are chosen, not sampled, this is recursive rejection sampling over
    siblings — a child is kept with the target's probability of its token among those not yet rejected, the
    bonus drawn from what remains — with one uniform per depth instead of one per sibling tried: the emitted
    tokens are distributed as target-only sampling's, and with the same uniforms they are its very tokens.
    """
    if target_probs.dim() != 2 or target_probs.shape[0] != tree.size:
        raise ValueError(f"target_probs must be [{tree.size}, V], got {list(target_probs.shape)}")
    total = target_probs.sum(dim=-1)
    if not bool(torch.isfinite(total).all() & (total > 0).all() & (target_probs >= 0).all()):  # (one sync)
        raise ValueError("a target distribution of the tree is not a probability vector")
    depths = tree.depths
    if len(uniforms) <= max(depths):
        raise ValueError(f"{len(uniforms)} uniforms for a tree {max(depths)} deep (one per depth, the root's first)")
    rows = torch.tensor([uniforms[d] for d in depths], dtype=torch.float32, device=target_probs.device)
    return accept_greedy(tree, sample_from_probs(target_probs.float(), rows))
