"""DraftTree: the token tree one request's draft proposes for one round.

Node 0 is the root: the last verified token, already decided, whose KV is not yet in the cache
(it is verified together with the drafted nodes). Nodes 1.. are drafted tokens; every node's parent
has a smaller index, so the nodes are in topological order. A chain (topk = 1) is the tree whose
parents are 0, 1, 2, ...

An in-process chain draft may leave its tokens on the device (``pending``): its shape is known before
the draft runs, so the verify can be staged and launched without waiting for the draft, and take the
tokens from the device; the host reads them with the verify's results (``resolve_pending``). Until
then ``tokens`` holds -1 for each such node.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int]  # node -> token id (target vocabulary); tokens[0] is the root
    parents: list[int]  # node -> parent node; parents[0] == -1
    scores: list[float] = field(default_factory=list)  # cumulative draft log-prob per node (root 0.0), optional
    pending: "PendingTokens | None" = None  # tokens still on the device (-1 in ``tokens`` until resolved)
    # Filler nodes only: a request that does not draft, verified as one row of a speculating batch's
    # width so that the batch keeps one width (one graphed forward); only its root's row counts.
    padding: bool = False

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError("a draft tree needs one parent per token and at least the root")
        if self.parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(self.parents[1:], start=1)):
            raise ValueError(f"draft tree parents must precede their children, got {self.parents}")

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        depth = [0] * self.size
        for i in range(1, self.size):
            depth[i] = depth[self.parents[i]] + 1
        return depth

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, self.size) if self.parents[i] == node]

    def ancestor_mask(self) -> list[list[bool]]:
        """``mask[i][j]`` is True when j is i or an ancestor of i: what node i may attend to."""
        mask = [[False] * self.size for _ in range(self.size)]
        for i in range(self.size):
            mask[i][i] = True
            if i:
                mask[i][: i] = [a or b for a, b in zip(mask[self.parents[i]][:i], mask[i][:i])]
        return mask

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's first child down to ``node`` (excludes the root)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @classmethod
    def chain(cls, root: int, tokens: list[int]) -> "DraftTree":
        return cls([root, *tokens], list(range(-1, len(tokens))))

    @classmethod
    def padded(cls, root: int, width: int) -> "DraftTree":
        """The bare root, filled out to ``width`` nodes (see ``padding``)."""
        return cls([root] * width, list(range(-1, width - 1)), padding=True)

    @property
    def drafted(self) -> bool:
        """Whether the tree holds drafts to accept (not the bare root, nor filler)."""
        return self.size > 1 and not self.padding


@dataclass
class PendingTokens:
    ids: torch.Tensor  # int64 [size] on the device: every node's token (the root's too)
    row: torch.Tensor  # float64 [3 * size + 1] on the device: tokens, parents, scores, NaN flag (draft_static)


def resolve_pending(trees: Iterable[DraftTree], keep_broken: bool = False) -> list[DraftTree]:
    """Fill in the tokens and scores that pending trees left on the device, in one device→host copy.
    A node whose token the host already set (a rewrite of the draft) keeps it.

    A tree whose draft log-probs came out NaN raises FloatingPointError, or with ``keep_broken`` is
    returned (the list of such trees): its tokens stay unknown (-1 past the root) and it is no longer
    pending. The engine, whose verify has already read such a tree, then accepts none of its nodes."""
    waiting = [t for t in trees if t.pending is not None]
    if not waiting:
        return []
    flat = torch.cat([t.pending.row for t in waiting]).cpu().tolist()
    offset, broken = 0, []
    for tree in waiting:
        n = tree.size
        row, offset = flat[offset : offset + 3 * n + 1], offset + 3 * n + 1
        tree.pending = None
        if row[3 * n]:
            if not keep_broken:
                raise FloatingPointError("draft log-probs contain NaN; the draft head or its features are broken")
            broken.append(tree)
            continue
        tree.tokens = [int(d) if t < 0 else t for t, d in zip(tree.tokens, row[:n])]
        tree.scores = row[2 * n : 3 * n]
    return broken
