"""DraftLink's held features (plain steps keep the drafter's input on the device for the request's next
draft): copies that survive the step's buffers being overwritten, one copy for a step's requests of one
shape, sent in order with what was held once a limit is passed."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tandem.engine import draft_link
from tandem.engine.draft_link import DraftLink


class Proposer:
    available = True

    def __init__(self):
        self.extended = []

    def extend(self, items):
        self.extended.append([(rid, list(tokens), feats.clone()) for rid, tokens, feats in items])


def request(rid: str):
    return SimpleNamespace(rid=rid, pending_extend=[], pending_bytes=0, draft_ready=False, attach_at=None)


def link():
    proposer = Proposer()
    return DraftLink(SimpleNamespace(proposer=proposer)), proposer


def test_held_rows_are_one_copy_that_outlives_the_step_buffer():
    drafts, proposer = link()
    reqs = [request(f"r{i}") for i in range(3)]
    step = torch.arange(12.0).view(4, 3)  # a verify's feature rows (a graph's static output)
    drafts.keep_in_step([(req, [10 + i], step[i : i + 1]) for i, req in enumerate(reqs)])
    want = step[:3].clone()
    step.fill_(-1.0)  # the next replay overwrites the buffer
    held = [req.pending_extend[0][1] for req in reqs]
    assert all(torch.equal(h, want[i : i + 1]) for i, h in enumerate(held))
    assert len({h.untyped_storage().data_ptr() for h in held}) == 1  # one copy for the three
    assert all(req.draft_ready for req in reqs) and proposer.extended == []
    assert drafts.held_bytes == sum(req.pending_bytes for req in reqs) == 3 * 3 * 4


def test_rows_of_other_shapes_are_copied_apart_and_a_request_past_its_limit_is_sent_in_order(monkeypatch):
    drafts, proposer = link()
    a, b, c = request("a"), request("b"), request("c")
    drafts.keep_in_step([(a, [1], torch.ones(1, 3)), (b, [2, 3], torch.full((2, 3), 2.0))])
    assert torch.equal(b.pending_extend[0][1], torch.full((2, 3), 2.0)) and len(a.pending_extend) == 1
    monkeypatch.setattr(draft_link, "PENDING_LIMIT_BYTES", 2 * 3 * 4)  # room for two rows a request
    drafts.keep_in_step([(a, [4], torch.full((1, 3), 4.0)), (b, [5], torch.full((1, 3), 5.0)),
                         (c, [6], torch.full((1, 3), 6.0))])
    (sent,) = proposer.extended
    assert [(rid, tokens) for rid, tokens, _ in sent] == [("b", [2, 3, 5])]  # its held rows first, then the new one
    assert torch.equal(sent[0][2], torch.tensor([[2.0] * 3, [2.0] * 3, [5.0] * 3]))
    assert [t for t, _ in a.pending_extend] == [[1], [4]] and b.pending_extend == [] and b.pending_bytes == 0
    assert drafts.held_bytes == a.pending_bytes + c.pending_bytes == 3 * 3 * 4


def test_while_the_batch_decodes_plainly_a_finish_sends_nothing_and_a_preemption_completes():
    """With the prefix cache: a request finishing while the batch decodes plainly is released without its held
    features (no drafter work); a preempted one first sends them, so that its recompute finds the drafter's
    pages whole; while the batch speculates a finish sends them too."""
    proposer = Proposer()
    proposer.caches_prefixes, released = True, []
    proposer.release = released.append
    engine = SimpleNamespace(proposer=proposer, prefix_cache=object(), speculating=False)
    drafts = DraftLink(engine)

    def holding(rid):
        req = request(rid)
        assert drafts.keep_in_step([(req, [5], torch.ones(1, 3))]) is False
        return req

    finished, preempted = holding("done"), holding("preempted")
    drafts.forget(finished, finishing=True)
    assert proposer.extended == [] and released == ["done"] and drafts.held_bytes > 0
    drafts.forget(preempted)
    assert [[rid for rid, _, _ in call] for call in proposer.extended] == [["preempted"]] and drafts.held_bytes == 0
    engine.speculating = True
    drafts.forget(holding("done while speculating"), finishing=True)
    assert proposer.extended[-1][0][0] == "done while speculating"


def test_a_catch_up_sends_each_requests_held_rows_in_order_in_one_extend():
    """Resuming: every request's held steps, in the order they were held, as one extend item each, all in one extend;
    nothing held after it (a request with nothing held is left out)."""
    drafts, proposer = link()
    reqs = [request(f"r{i}") for i in range(3)]
    for step in range(4):
        rows = torch.arange(3 * 2.0).view(3, 2) + 10 * step
        drafts.keep_in_step([(req, [100 * step + i], rows[i : i + 1]) for i, req in enumerate(reqs[:2])]
                            + ([(reqs[2], [7, 8], torch.full((2, 2), -1.0))] if step == 0 else []))
    drafts.flush_pending(reqs + [request("idle")])
    (sent,) = proposer.extended
    assert [rid for rid, _, _ in sent] == ["r0", "r1", "r2"]
    for i, (_, tokens, feats) in enumerate(sent[:2]):
        assert tokens == [100 * step + i for step in range(4)]
        assert torch.equal(feats, torch.stack([torch.arange(3 * 2.0).view(3, 2)[i] + 10 * step for step in range(4)]))
    assert sent[2][1] == [7, 8] and torch.equal(sent[2][2], torch.full((2, 2), -1.0))
    assert all(req.pending_extend == [] and req.pending_bytes == 0 for req in reqs) and drafts.held_bytes == 0


def test_a_runs_own_features_are_held_as_they_are_in_request_order():
    """A queued run's features ([steps, n, F], its own tensor) are held without a copy: each request its column."""
    drafts, proposer = link()
    reqs = [request(f"r{i}") for i in range(3)]
    run = torch.arange(2 * 3 * 4.0).view(2, 3, 4)
    drafts.keep_in_step([(req, [i, i], column) for i, (req, column) in enumerate(zip(reqs, run.unbind(1)))],
                        owned=True)
    for i, req in enumerate(reqs):
        ((tokens, held),) = req.pending_extend
        assert tokens == [i, i] and torch.equal(held, run[:, i]) and req.draft_ready
        assert held.untyped_storage().data_ptr() == run.untyped_storage().data_ptr()  # (no copy)
    assert drafts.held_bytes == 3 * 2 * 4 * 4 and proposer.extended == []


def test_a_runs_features_are_copied_when_one_request_is_sent_now(monkeypatch):
    """A held view would keep the whole run alive, rows sent on included, beyond what the held bytes count: where a
    request past its limit is sent now, the others' columns are copied as a graph buffer's are."""
    drafts, proposer = link()
    a, b = request("a"), request("b")
    monkeypatch.setattr(draft_link, "PENDING_LIMIT_BYTES", 2 * 4 * 4)
    drafts.keep_in_step([(b, [0], torch.zeros(1, 4))])  # b holds a row already: one more passes its limit
    run = torch.arange(2 * 2 * 4.0).view(2, 2, 4)
    drafts.keep_in_step([(a, [1, 2], run[:, 0]), (b, [3, 4], run[:, 1])], owned=True)
    ((_, held),) = a.pending_extend
    assert torch.equal(held, run[:, 0]) and held.untyped_storage().data_ptr() != run.untyped_storage().data_ptr()
    assert [rid for rid, _, _ in proposer.extended[0]] == ["b"] and b.pending_extend == []
