"""Draft trees in a Drafts reply, packed (protocol 2): the drafter packs them in the order the Round
asked for them, the verifier unpacks them by that order. One definition for both services (and for
bench/round_messages.py, which times them), kept in the core package: tandem/rpc/ holds only the
generated stubs (scripts/gen_proto.py), and services may not import each other."""

from __future__ import annotations

from tandem.rpc.drafter.v1 import drafter_pb2 as pb
from tandem.speculative.tree import DraftTree


def pack_trees(drafts: pb.Drafts, trees: list[DraftTree]) -> None:
    """Append ``trees`` to ``drafts``: tree i is the next tree_sizes[i] entries of each list."""
    for tree in trees:
        drafts.tree_sizes.append(tree.size)
        drafts.tree_tokens.extend(tree.tokens)
        drafts.tree_parents.extend(tree.parents)
        # scores are optional in a DraftTree: none becomes zeros; a wrong count is a drafter bug
        drafts.tree_scores.extend(tree.scores or [0.0] * tree.size)


def unpack_trees(drafts: pb.Drafts, count: int) -> list[DraftTree]:
    """The ``count`` trees a Drafts carries packed, in the order they were asked for; ValueError when
    the reply does not hold exactly that (or a tree is malformed)."""
    sizes = list(drafts.tree_sizes)
    tokens, parents, scores = list(drafts.tree_tokens), list(drafts.tree_parents), list(drafts.tree_scores)
    total = sum(sizes)
    if len(sizes) != count or not len(tokens) == len(parents) == len(scores) == total:
        raise ValueError(f"the drafter returned {len(sizes)} trees ({len(tokens)} tokens, {len(parents)} parents, "
                         f"{len(scores)} scores) for {count} requests ({total} nodes)")
    trees, at = [], 0
    for n in sizes:
        trees.append(DraftTree(tokens[at : at + n], parents[at : at + n], scores[at : at + n]))
        at += n
    return trees
