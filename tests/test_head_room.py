"""A head whose KV pool cannot hold every running request (tandem/speculative/head_room.py): the newest give way,
the others draft exactly as with room to spare, and nothing raises. The drafter service used to fail the round
(OutOfPagesError), close its round lane and meet the same failure after every reconnect."""

from __future__ import annotations

import logging

import pytest

from draft_checkpoints import draft_inputs, pair_drafter
from tandem.errors import OutOfPagesError
from tandem.speculative.spec_config import SpecConfig

PAGE = 4
CHAIN = SpecConfig(3, 1, 4)
TREE = SpecConfig(3, 2, 5)


def seqs(n: int, length: int = 10) -> dict[str, tuple[list[int], object]]:
    return {f"r{i}": draft_inputs(40 + i, length) for i in range(n)}


def roomy(pair):
    return pair_drafter(pair, page_size=PAGE, kv_pages=256)


def trees_of(drafter, rids, spec):
    return [(t.tokens, t.parents) for t in drafter.draft(rids, spec)]


def test_an_extend_the_pool_cannot_hold_sheds_the_newest_requests(pair, caplog):
    """Three requests of 10 entries (3 pages each) in a pool of 12 usable pages; a fourth of 20 entries (5 pages)
    arrives: it is shed (its drafts are bare roots at its last token), the first three draft what a pool with room
    drafts for them (their scratch: a page each)."""
    small, big = pair_drafter(pair, page_size=PAGE, kv_pages=13), roomy(pair)
    data = seqs(3) | {"r3": draft_inputs(43, 20)}
    for d in (small, big):
        d.extend([(rid, t, f) for rid, (t, f) in list(data.items())[:3]])
    with caplog.at_level(logging.WARNING, "tandem.drafter"):
        small.extend([("r3", *data["r3"])])  # used to raise OutOfPagesError
    big.extend([("r3", *data["r3"])])
    assert "r3" in small.shed and not small.has("r3") and "cannot hold every running request" in caplog.text
    rids = ["r0", "r3", "r1", "r2"]
    for spec in (CHAIN, TREE):
        got, want = trees_of(small, rids, spec), trees_of(big, rids, spec)
        assert got[1] == ([data["r3"][0][-1]], [-1])  # a bare root: verified as a plain step
        assert [got[0], got[2], got[3]] == [want[0], want[2], want[3]] and len(want[1][0]) > 1
    # its later extends only move the root; releasing it forgets it; a join (attach_prefix) starts it again
    tokens, feats = draft_inputs(99, 2)
    small.extend([("r3", tokens, feats)])
    assert trees_of(small, ["r3"], CHAIN) == [([tokens[-1]], [-1])]
    small.release("r0")
    small.attach_prefix("r3", data["r3"][0][:1])
    assert "r3" not in small.shed and small.has("r3")
    small.release("r3")
    with pytest.raises(KeyError, match="unknown request"):
        small.draft(["r3"], CHAIN)


def test_the_newest_give_way_first_within_one_extend_and_the_oldest_keep_their_state(pair):
    """One extend of a running request and two new ones that do not all fit: the new ones go, the newest first,
    until the rest fits; the running request keeps drafting as with room."""
    small, big = pair_drafter(pair, page_size=PAGE, kv_pages=7), roomy(pair)  # 6 usable pages
    data = seqs(3, 8)  # 2 pages each
    for d in (small, big):
        d.extend([("r0", *data["r0"])])
    more = draft_inputs(7, 4)  # r0 grows to 12 entries: 3 pages
    batch = [("r0", *more), ("r1", *data["r1"]), ("r2", *data["r2"])]  # needs 1 + 2 + 2 of 4 free
    small.extend(batch)
    big.extend(batch)
    assert small.has("r0") and small.has("r1") and "r2" in small.shed
    small.extend([("r0", *draft_inputs(8, 8)), ("r1", *draft_inputs(9, 1))])  # needs 2 + 1 of 1 free: r1 goes
    big.extend([("r0", *draft_inputs(8, 8)), ("r1", *draft_inputs(9, 1))])
    assert small.has("r0") and "r1" in small.shed
    assert trees_of(small, ["r0"], TREE) == trees_of(big, ["r0"], TREE)


def test_a_draft_whose_scratch_does_not_fit_leaves_the_newest_out_of_this_draft_only(pair):
    """Extends that fill whole pages leave one page for a 4-step draft's scratch entries (3, a page a request): the
    oldest request drafts as with room, the newer two get bare roots this draft and keep their state, which drafts as
    with room once a release makes space."""
    small, big = pair_drafter(pair, page_size=PAGE, kv_pages=8), roomy(pair)  # 7 usable pages
    data = seqs(3, 8)  # 2 full pages each: 1 page free
    for d in (small, big):
        d.extend(list((rid, t, f) for rid, (t, f) in data.items()))
    spec, rids = SpecConfig(4, 1, 5), ["r2", "r0", "r1"]
    got, want = trees_of(small, rids, spec), trees_of(big, rids, spec)
    assert got[1] == want[1] and len(want[1][0]) == 5
    assert got[0] == ([data["r2"][0][-1]], [-1]) and got[2] == ([data["r1"][0][-1]], [-1])
    assert not small.shed.roots and small.has("r1") and small.has("r2")  # left out of one draft, not shed
    small.release("r0")  # 3 pages free: both drafts fit
    assert trees_of(small, ["r1", "r2"], spec) == [want[2], want[0]]


def test_logits_extends_still_refuse_what_does_not_fit(pair):
    """An extend asked for its logits (training, the reference tests) answers every item or raises."""
    small = pair_drafter(pair, page_size=PAGE, kv_pages=3)
    with pytest.raises(OutOfPagesError, match="out of pages"):
        small.extend([("a", *draft_inputs(1, 12))], return_logits=True)
