"""The verifier's drafter client keeps the shared-memory ring from filling when many extends arrive
at once (a batch of prefills, the catch-ups of requests that decoded plainly for a while)."""

from __future__ import annotations

import torch

from tandem.ring import HiddenRing
from tandem.rpc.drafter.v1 import drafter_pb2 as pb
from verifier.drafter_client import DrafterClient


class EchoConnection:
    """Stands in for the stream: answers every round at once, recording the rows it carried."""

    def __init__(self):
        self.round_rows: list[int] = []

    def exchange(self, message: pb.VerifierMessage, timeout_s: float) -> pb.DrafterMessage:
        self.round_rows.append(sum(e.ring_rows for e in message.round.extend))
        return pb.DrafterMessage(drafts=pb.Drafts(seq=message.round.seq))

    def close(self) -> None:
        pass


def test_many_extends_at_once_go_out_in_rounds_that_fit_the_ring():
    with HiddenRing.create(64, 4, "float32") as ring:
        client = DrafterClient("127.0.0.1:1", ring, pb.TargetInfo(), deadline_s=1.0)
        client.FLUSH_ROWS = 16
        conn = client._conn = EchoConnection()  # connected; the reconnect thread is never started
        ring.begin_round(client._seq)
        items = [(f"req-{i}", list(range(10)), torch.full((10, 4), float(i))) for i in range(20)]
        client.extend(items)  # 200 rows through a 64-row ring
        assert client.available, "the ring never filled, so the drafter was not dropped"
        assert conn.round_rows and all(rows <= 16 for rows in conn.round_rows)
        pending = sum(e.ring_rows for e in client._pending_extend)
        assert sum(conn.round_rows) + pending == 200  # nothing lost: the rest rides with the next draft
        client.draft([], None)
        assert sum(conn.round_rows) == 200 and ring.live() == []


def test_a_prompt_longer_than_the_ring_goes_in_pieces():
    with HiddenRing.create(64, 4, "float32") as ring:
        client = DrafterClient("127.0.0.1:1", ring, pb.TargetInfo(), deadline_s=1.0)
        client.FLUSH_ROWS = 16
        conn = client._conn = EchoConnection()
        ring.begin_round(client._seq)
        features = torch.arange(100 * 4, dtype=torch.float32).view(100, 4)
        client.extend([("long", list(range(100)), features)])  # 100 rows through a 64-row ring
        client.draft([], None)
        assert client.available and sum(conn.round_rows) == 100 and all(r <= 16 for r in conn.round_rows)


def test_trees_travel_packed_in_the_order_they_were_asked_for():
    import pytest

    from verifier.drafter_client import unpack_trees

    drafts = pb.Drafts(seq=3, tree_sizes=[1, 4, 3], tree_tokens=[7, 9, 1, 2, 3, 5, 6, 4],
                       tree_parents=[-1, -1, 0, 1, 1, -1, 0, 0], tree_scores=[0, 0, -.5, -1, -2, 0, -.1, -.2])
    trees = unpack_trees(drafts, 3)
    assert [t.tokens for t in trees] == [[7], [9, 1, 2, 3], [5, 6, 4]]
    assert [t.parents for t in trees] == [[-1], [-1, 0, 1, 1], [-1, 0, 0]]
    assert trees[2].scores == pytest.approx([0, -.1, -.2])
    with pytest.raises(ValueError, match="2 trees"):
        unpack_trees(pb.Drafts(tree_sizes=[1, 1], tree_tokens=[1, 2], tree_parents=[-1, -1], tree_scores=[0, 0]), 3)
    with pytest.raises(ValueError, match="3 tokens"):
        unpack_trees(pb.Drafts(tree_sizes=[2], tree_tokens=[1, 2, 3], tree_parents=[-1, 0], tree_scores=[0, 0]), 1)
    with pytest.raises(ValueError, match="parents"):  # a malformed tree is a broken reply too
        unpack_trees(pb.Drafts(tree_sizes=[2], tree_tokens=[1, 2], tree_parents=[-1, 1], tree_scores=[0, 0]), 1)
