"""DraftTree: the token tree one request's draft proposes for one round.

Node 0 is the root: the last verified token, already decided, whose KV is not yet in the cache
(it is verified together with the drafted nodes). Nodes 1.. are drafted tokens; every node's parent
has a smaller index, so the nodes are in topological order. A chain (topk = 1) is the tree whose
parents are 0, 1, 2, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftTree:
    tokens: list[int]  # node -> token id (target vocabulary); tokens[0] is the root
    parents: list[int]  # node -> parent node; parents[0] == -1
    scores: list[float] = field(default_factory=list)  # cumulative draft log-prob per node (root 0.0), optional

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
