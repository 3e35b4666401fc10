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
  is drawn from that residual. Then the first emitted token is distributed exactly as p, and, given
  it, the next one as the target distribution at the chosen child, and so on.

``target_probs`` must already be the request's *adjusted* distribution (``tandem.sampling.adjusted_probs``:
temperature, top-k, top-p), so what is accepted and what plain decoding samples are the same thing.
All randomness comes from the request's own CPU generator, so a seeded request is reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

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


def _draw(generator: torch.Generator) -> float:
    return float(torch.rand(1, generator=generator, dtype=torch.float64))


def _sample_residual(residual: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw from an unnormalised float64 distribution that can never land on a zero entry.

    ``searchsorted(right=True)`` returns the first index whose CDF exceeds ``u·total``, which is always
    a token with positive mass (a zero entry leaves the CDF flat). ``u < 1`` keeps ``u·total`` below
    ``total`` in IEEE arithmetic; the clamp to the last positive token is a guard that a clamp to V-1
    would not be (token V-1 may have probability 0).
    """
    cdf = residual.cumsum(0)
    target = _draw(generator) * float(cdf[-1])
    idx = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True))
    last_positive = int(torch.nonzero(residual > 0)[-1])
    return min(idx, last_positive)


def accept_sampling(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator) -> AcceptResult:
    """Recursive rejection sampling over siblings for a deterministic (top-k) draft.

    ``target_probs`` is ``[tree.size, V]``: row i is the request's adjusted target distribution after
    node i. Children are tried in index order; a token that an earlier sibling already carried counts
    as rejected (its mass is already zero in the residual). Uniforms come only from ``generator``.
    """
    if target_probs.dim() != 2 or target_probs.shape[0] != tree.size:
        raise ValueError(f"target_probs must be [{tree.size}, V], got {list(target_probs.shape)}")
    children = _children_lists(tree)
    accepted: list[int] = []
    node = 0
    while True:
        # float64 on the CPU: the residual mass shrinks with every rejection, and float32 would make
        # p(x)/remaining inaccurate exactly when few tokens remain. Only visited rows are moved.
        p = target_probs[node].detach().to(device="cpu", dtype=torch.float64)
        total = float(p.sum())  # NaN or inf anywhere makes the sum non-finite
        if not (math.isfinite(total) and total > 0.0) or float(p.min()) < 0.0:
            raise ValueError(f"target distribution at node {node} is not a probability vector")
        residual, remaining = p.clone(), total
        chosen = None
        for child in children[node]:
            token = tree.tokens[child]
            mass = float(residual[token])
            if mass <= 0.0:
                continue  # zero target probability, or a sibling already tried (and rejected) this token
            ratio = mass / remaining
            if ratio >= 1.0 or _draw(generator) < ratio:
                chosen = child
                break
            residual[token] = 0.0
            remaining = float(residual.sum())  # recomputed, not decremented: subtraction loses precision
        if chosen is None:
            if remaining <= 0.0:
                # Only reachable through rounding (the last token with mass has ratio exactly 1 and is
                # always accepted); fall back to the full distribution rather than emit a zero-p token.
                residual = p
            return _result(tree, accepted, _sample_residual(residual, generator))
        accepted.append(chosen)
        node = chosen


def node_offsets(trees: Sequence[DraftTree]) -> list[int]:
    """Start row of each tree in a batch's stacked ``[sum n_nodes, ...]`` verify outputs."""
    offsets, total = [], 0
    for tree in trees:
        offsets.append(total)
        total += tree.size
    return offsets


def accept_batch(
    trees: Sequence[DraftTree],
    greedy: Sequence[bool],
    target_argmax: torch.Tensor | None = None,
    target_probs: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[AcceptResult]:
    """Accept every request of a verify batch; rows of the stacked inputs follow ``node_offsets(trees)``.

    Greedy requests read ``target_argmax`` ([sum n_nodes] ints), the others ``target_probs``
    ([sum n_nodes, V]) and their own generator. The argmax moves to the host once for the whole batch.
    """
    offsets = node_offsets(trees)
    argmax = target_argmax.tolist() if isinstance(target_argmax, torch.Tensor) else target_argmax
    results = []
    for i, (tree, start) in enumerate(zip(trees, offsets)):
        rows = slice(start, start + tree.size)
        if greedy[i]:
            if argmax is None:
                raise ValueError("a greedy request needs target_argmax")
            results.append(accept_greedy(tree, argmax[rows]))
        else:
            if target_probs is None or generators is None or generators[i] is None:
                raise ValueError("a sampled request needs target_probs and its generator")
            results.append(accept_sampling(tree, target_probs[rows], generators[i]))
    return results
