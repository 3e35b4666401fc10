"""The verifier's drafter client keeps the shared-memory ring from filling when many extends arrive
at once (a batch of prefills, the catch-ups of requests that decoded plainly for a while)."""

from __future__ import annotations

import contextlib

import torch

from tandem.ring import HiddenRing
from tandem.rpc.drafter.v1 import drafter_pb2 as pb
from verifier.drafter_client import DrafterClient


class EchoConnection:
    """Stands in for the stream: answers every round at once, recording the rows it carried."""

    def __init__(self):
        self.round_rows: list[int] = []
        self.rounds: list[pb.Round] = []

    def send_round(self, message: pb.VerifierMessage, timeout_s: float) -> None:
        self.round_rows.append(sum(e.ring_rows for e in message.round.extend))
        self.rounds.append(message.round)
        self._reply = pb.DrafterMessage(drafts=pb.Drafts(seq=message.round.seq))

    def receive_round(self, timeout_s: float) -> pb.DrafterMessage:
        return self._reply

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

    from tandem.speculative.tree_wire import unpack_trees

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


class DraftingConnection:
    """Stands in for the stream: answers every Round at once with one two-node tree per draft request,
    whose tokens name the Round and the request's position in it ([seq, position])."""

    def __init__(self):
        self.rounds: list[pb.Round] = []

    def send_round(self, message: pb.VerifierMessage, timeout_s: float) -> None:
        r = message.round
        self.rounds.append(r)
        drafts = pb.Drafts(seq=r.seq)
        for i, _ in enumerate(r.draft):
            drafts.tree_sizes.append(2)
            drafts.tree_tokens.extend([r.seq, i])
            drafts.tree_parents.extend([-1, 0])
            drafts.tree_scores.extend([0.0, -1.0])
        self._reply = pb.DrafterMessage(drafts=drafts)

    def receive_round(self, timeout_s: float) -> pb.DrafterMessage:
        return self._reply

    def close(self) -> None:
        pass


def _prefetching_client(ring):
    from tandem.speculative.spec_config import SpecConfig

    kinds = []
    client = DrafterClient("127.0.0.1:1", ring, pb.TargetInfo(), deadline_s=1.0,
                           on_round=lambda round_trip, wait, drafts, kind: kinds.append(kind))
    conn = client._conn = DraftingConnection()
    ring.begin_round(client._seq)
    return client, conn, kinds, SpecConfig(3, 1, 4)


def test_a_prefetched_round_answers_the_next_draft_of_the_same_requests():
    with HiddenRing.create(64, 4, "float32") as ring:
        client, conn, kinds, spec = _prefetching_client(ring)
        client.extend([("a", [5], torch.ones(1, 4)), ("b", [6], torch.ones(1, 4))])
        client.prefetch(["a", "b"], spec)
        assert len(conn.rounds) == 1 and [d.request_id for d in conn.rounds[0].draft] == ["a", "b"]
        assert len(conn.rounds[0].extend) == 2  # what was queued rides with it
        seq = conn.rounds[0].seq
        trees = client.draft(["a", "b"], spec)
        assert len(conn.rounds) == 1, "the draft must use the prefetched reply, not send another Round"
        assert [t.tokens for t in trees] == [[seq, 0], [seq, 1]] and kinds == ["prefetched"]
        assert ring.live() == []  # the reply freed the round's rows
        # A subset of the prefetched requests is served from it too, each with its own tree.
        client.prefetch(["a", "b"], spec)
        seq = conn.rounds[-1].seq
        assert [t.tokens for t in client.draft(["b"], spec)] == [[seq, 1]] and len(conn.rounds) == 2


def test_requests_that_changed_since_the_prefetch_are_drafted_in_a_round_of_their_own():
    from tandem.speculative.spec_config import SpecConfig

    with HiddenRing.create(64, 4, "float32") as ring:
        client, conn, kinds, spec = _prefetching_client(ring)
        # "a" extended after the prefetch: its prefetched tree is stale; "b"'s is not.
        client.prefetch(["a", "b"], spec)
        early = conn.rounds[-1].seq
        client.extend([("a", [7, 8], torch.ones(2, 4))])
        trees = client.draft(["a", "b"], spec)
        assert len(conn.rounds) == 2 and kinds == ["prefetched", "direct"]
        fresh = conn.rounds[1]
        assert [e.request_id for e in fresh.extend] == ["a"] and [d.request_id for d in fresh.draft] == ["a"]
        assert [t.tokens for t in trees] == [[fresh.seq, 0], [early, 1]]
        # A request the prefetch did not ask for: drafted on its own, the others from the prefetch.
        client.prefetch(["a", "b"], spec)
        early = conn.rounds[-1].seq
        trees = client.draft(["b", "c"], spec)
        assert [d.request_id for d in conn.rounds[-1].draft] == ["c"] and kinds[-2:] == ["prefetched", "direct"]
        assert [t.tokens for t in trees] == [[early, 1], [conn.rounds[-1].seq, 0]]
        # Nothing usable (released since; another spec): the prefetch is dropped, all drafted afresh.
        for change, asked, asked_spec in ((lambda: client.release("a"), ["a"], spec),
                                          (lambda: None, ["a", "b"], SpecConfig(2, 1, 3))):
            client.prefetch(["a", "b"], spec)
            change()
            before = len(conn.rounds)
            trees = client.draft(asked, asked_spec)
            assert len(conn.rounds) == before + 1 and kinds[-2:] == ["prefetch_dropped", "direct"]
            assert [d.request_id for d in conn.rounds[-1].draft] == asked
            assert [t.tokens for t in trees] == [[conn.rounds[-1].seq, i] for i in range(len(asked))]
        assert ring.live() == []


def test_a_prefetched_reply_is_used_however_long_the_engine_took_to_collect_it():
    """A pause in speculation can leave a prefetched reply uncollected past the deadline: the drafter
    answered in time, so it is used, and the drafter is not dropped."""
    import time

    with HiddenRing.create(64, 4, "float32") as ring:
        client, conn, kinds, spec = _prefetching_client(ring)
        client.deadline_s = 0.05
        client.prefetch(["a"], spec)
        time.sleep(0.15)
        assert [t.tokens for t in client.draft(["a"], spec)] == [[conn.rounds[-1].seq, 0]]
        assert client.available and kinds == ["prefetched"]


def test_a_lost_connection_or_a_flush_leaves_no_prefetch_behind():
    with HiddenRing.create(64, 4, "float32") as ring:
        client, conn, kinds, spec = _prefetching_client(ring)
        client.prefetch(["a"], spec)
        client.discard("an unusable tree")  # the connection is dropped, and the Round in flight with it
        assert not client.available and client._prefetched is None and ring.live() == []
        conn = client._conn = DraftingConnection()  # reconnected: a fresh stream
        client.draft(["a"], spec)
        assert kinds == ["direct"]  # the dropped prefetch is never collected
        assert [d.request_id for d in conn.rounds[-1].draft] == ["a"] and len(conn.rounds) == 1
        # Extends past FLUSH_ROWS flush in an extend-only Round, which first collects the prefetch.
        client.FLUSH_ROWS = 8
        client.prefetch(["a"], spec)
        client.extend([(f"r{i}", list(range(6)), torch.ones(6, 4)) for i in range(3)])
        assert kinds[1:3] == ["prefetch_dropped", "flush"] and client._prefetched is None
        client.draft(["a"], spec)
        assert client.available and ring.live() == []


def test_nothing_is_prefetched_while_a_round_is_in_flight_or_the_drafter_is_away():
    with HiddenRing.create(64, 4, "float32") as ring:
        client, conn, kinds, spec = _prefetching_client(ring)
        client.prefetch(["a"], spec)
        client.prefetch(["b"], spec)  # one Round in flight at most: this one is not sent
        assert len(conn.rounds) == 1
        client.draft(["a"], spec)
        client._conn = None
        client.prefetch(["a"], spec)  # away: nothing to send, nothing raised (the engine decodes on)
        assert len(conn.rounds) == 1


class RunConnection(EchoConnection):
    """Answers each Round at once; a ChainRun is refused while ``refuse`` says why, or when longer than ``fits`` rounds
    (the drafter's pages: the reply then says how many fit)."""

    def __init__(self):
        super().__init__()
        self.refuse, self.runs, self.fits = "", [], None
        self.welcome = pb.Welcome(chain_runs=True)

    def send_round(self, message: pb.VerifierMessage, timeout_s: float) -> None:
        super().send_round(message, timeout_s)
        if message.round.HasField("chain_run"):
            self.runs.append(message.round.chain_run)
            too_long = self.fits is not None and message.round.chain_run.rounds > self.fits
            self._reply.drafts.chain_run_refused = self.refuse or (
                "the run does not fit the drafter's graphs or pages" if too_long else "")
            self._reply.drafts.chain_run_fits = self.fits if too_long and not self.refuse else 0


@contextlib.contextmanager
def _run_client():
    """A client with a round mailbox on a RunConnection (its drafter's answers) → (client, connection, mailbox)."""
    from tandem.speculative.round_mailbox import MailboxLayout, RoundMailbox

    with HiddenRing.create(64, 4, "float32") as ring:
        box = RoundMailbox.create(MailboxLayout(2, 4, 4, torch.float32), "cpu")
        try:
            client = DrafterClient("127.0.0.1:1", ring, pb.TargetInfo(vocab_size=100), deadline_s=1.0, mailbox=box)
            conn = client._conn = RunConnection()
            ring.begin_round(client._seq)
            yield client, conn, box
        finally:
            box.close()


def test_runs_are_announced_numbered_refused_and_released_on_a_lost_drafter():
    from tandem.speculative.spec_config import SpecConfig
    from tandem.speculative.round_mailbox import DRAFTED

    spec = SpecConfig(3, 1, 4)
    with _run_client() as (client, conn, box):
        assert client.chain_runs_available
        first = client.queue_run(["a", "b"], spec, 4, False, [5, 6])
        second = client.queue_run(["a", "b"], spec, 3, True, [5, 6])
        assert [(r.first_round, r.rounds, r.continues, list(r.request_ids)) for r in conn.runs] == [
            (0, 4, False, ["a", "b"]), (4, 3, True, ["a", "b"])]  # round numbers never go back
        assert conn.runs[0].spec.num_draft_tokens == 4 and first.next_round == 0 and second.next_round == 4
        conn.refuse = "the run does not fit the drafter's pages"
        assert client.queue_run(["a"], spec, 4, False, [5]) is None
        assert not client.chain_runs_available  # rounds go one at a time for a while
        assert client._next_round == 7  # a refused run takes no numbers
        client.discard("gone")  # a lost drafter: the verifier's waits must not hang on its flags
        assert box.flags[DRAFTED] == 7


def test_a_run_the_drafters_pages_hold_only_in_part_is_asked_again_as_long_as_they_hold():
    """The drafter refuses a run its pages cannot hold and says how many of its rounds fit: the client asks that run
    at once (runs stay on), where it used to back off and ask the same full run again, refused every time under page
    pressure."""
    from tandem.speculative.spec_config import SpecConfig

    spec = SpecConfig(3, 1, 4)
    with _run_client() as (client, conn, box):
        conn.fits = 2
        side = client.queue_run(["a"], spec, 4, False, [5])
        assert side is not None and side.rounds == 2 and side.last_needed == 2
        assert [(r.first_round, r.rounds) for r in conn.runs] == [(0, 4), (0, 2)]
        assert client.chain_runs_available and client._next_round == 2
        conn.fits = 0  # nothing fits: refused, as before
        assert client.queue_run(["a"], spec, 4, False, [5]) is None and not client.chain_runs_available
        assert client._next_round == 2
        client.discard("done")


def test_a_run_whose_answer_is_lost_keeps_its_round_numbers():
    """The drafter may have queued a run whose answer never came (the connection dropped meanwhile): its release at the
    connection's end raises the accepted flag past that run's rounds, so a later run numbered the same would find its
    waits passed at once and read what was never accepted. A lost answer keeps the numbers taken."""
    import pytest

    from tandem.speculative.proposer import ProposerUnavailable
    from tandem.speculative.spec_config import SpecConfig

    class LostAnswer(RunConnection):
        def receive_round(self, timeout_s):
            raise ProposerUnavailable("the drafter's connection closed")

    with _run_client() as (client, _, box):
        client._conn = LostAnswer()
        with pytest.raises(ProposerUnavailable):
            client.queue_run(["a"], SpecConfig(3, 1, 4), 4, False, [5])
        assert client._next_round == 4  # the next run starts past the lost one's rounds


class FakeHandshakes:
    """Stands in for DrafterConnection's constructor (the handshake) in verifier.drafter_reconnect: each
    attempt raises ``refusal`` while it is set, else blocks until ``proceed`` is set and connects."""

    def __init__(self):
        import threading

        self.refusal: Exception | None = None
        self.attempts, self.hellos, self.made = 0, [], []
        self.proceed, self.started = threading.Event(), threading.Event()
        self.proceed.set()

    def __call__(self, address, hello, timeout_s, loop, loop_lock, offer_lane, metadata):
        self.attempts += 1
        self.hellos.append(hello)
        if self.refusal is not None:
            raise self.refusal
        self.started.set()
        self.proceed.wait(10.0)
        conn = DraftingConnection()
        conn.welcome, conn.lane, conn.closed, conn.ended = pb.Welcome(draft_model="fake-head"), None, False, False
        conn.close = lambda: setattr(conn, "closed", True)
        conn.gone = lambda: conn.ended
        self.made.append(conn)
        return conn


def _reconnecting(ring, on_state) -> DrafterClient:
    """A started client whose reconnector looks every 10 ms (its handshakes: FakeHandshakes, patched in)."""
    client = DrafterClient("127.0.0.1:1", ring, pb.TargetInfo(), deadline_s=1.0, reconnect_interval_s=0.01,
                           on_state=on_state)
    client.start()
    return client


def _wait_until(condition, timeout_s=10.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_the_reconnector_logs_a_refusal_once_connects_when_it_can_and_again_after_a_drop(monkeypatch, caplog):
    import logging

    import grpc

    from tandem.rpc.drafter.v1 import PROTOCOL_VERSION
    from tandem.speculative.proposer import ProposerUnavailable

    handshakes = FakeHandshakes()
    monkeypatch.setattr("verifier.drafter_reconnect.DrafterConnection", handshakes)
    refusal = ProposerUnavailable("taken")
    refusal.status, refusal.details = grpc.StatusCode.ALREADY_EXISTS, "another verifier holds the stream"
    handshakes.refusal = refusal
    with HiddenRing.create(64, 4, "float32") as ring, caplog.at_level(logging.DEBUG, logger="verifier.drafter_client"):
        states = []
        client = _reconnecting(ring, lambda up: states.append((up, client.available)))
        try:
            assert _wait_until(lambda: handshakes.attempts >= 3) and not client.available
            refused = [r for r in caplog.records if "refused this verifier" in r.getMessage()]
            assert len(refused) == 1 and refused[0].levelno == logging.ERROR  # said once, however many tries
            assert client._reconnector.last_refusal == "another verifier holds the stream"
            hello = handshakes.hellos[0].hello
            assert hello.protocol_version == PROTOCOL_VERSION and hello.ring.name == ring.spec.name
            # Things queued before the connection must not reach the drafter on it.
            client._pending_release.append("stale")
            client._pending_start["stale"] = pb.PrefixStart(token_ids=[1])
            seq = client._seq
            handshakes.refusal = None  # the drafter is free again
            assert client.wait_connected(10.0) and client._conn is handshakes.made[0]
            # told after the connection is in place (and logged), on the reconnector's thread: waited for
            assert _wait_until(lambda: states == [(True, True)])
            assert client._seq == seq + 1 and not client._pending_release and not client._pending_start
            assert any("connected to the drafter at 127.0.0.1:1 (fake-head); rounds on the gRPC stream"
                       in r.getMessage() for r in caplog.records)
            client.draft([], None)  # the first Round of the connection carries its first seq
            assert handshakes.made[0].rounds[0].seq == seq + 1
            with client._lock:
                client._drop("a broken stream")  # the client's drop alone makes the reconnector reconnect
            assert handshakes.made[0].closed and states[-1] == (False, False)
            assert _wait_until(lambda: len(handshakes.made) == 2 and client.available and states[-1] == (True, True))
            assert client._conn is handshakes.made[1]
        finally:
            client.close()
        assert not client.available and handshakes.made[1].closed


def test_a_drafter_that_goes_while_no_round_runs_is_dropped_and_its_successor_connected(monkeypatch):
    """A detached drafter gets no rounds: one that died was found only at the next round (13 s after a kill, its
    restarted successor ready 10 s earlier, tandem:drafter_up still 1). The reconnector's looks drop it."""
    handshakes = FakeHandshakes()
    monkeypatch.setattr("verifier.drafter_reconnect.DrafterConnection", handshakes)
    with HiddenRing.create(64, 4, "float32") as ring:
        states = []
        client = _reconnecting(ring, states.append)
        try:
            assert client.wait_connected(10.0) and states == [True]
            assert _wait_until(lambda: False, 0.1) is False and client._conn is handshakes.made[0]  # alive: kept
            client.draft([], None)
            client.draft([], None)
            assert client.connection == 1  # (rounds do not count: the engine forgets draft state when this changes)
            handshakes.made[0].ended = True  # the process died; nothing is sent to it
            assert _wait_until(lambda: len(handshakes.made) == 2 and client.available)
            assert handshakes.made[0].closed and states == [True, False, True] and client.connection == 2
        finally:
            client.close()


def test_a_connection_made_while_the_client_closes_is_closed_and_never_used(monkeypatch):
    handshakes = FakeHandshakes()
    handshakes.proceed.clear()  # the handshake runs until the test lets it finish
    monkeypatch.setattr("verifier.drafter_reconnect.DrafterConnection", handshakes)
    with HiddenRing.create(64, 4, "float32") as ring:
        states = []
        client = _reconnecting(ring, states.append)
        assert handshakes.started.wait(10.0)
        client.close()
        handshakes.proceed.set()
        client._reconnector._thread.join(10.0)
        assert not client._reconnector._thread.is_alive()  # closed: no further attempt
        assert handshakes.made[0].closed and not client.available and states == []
        assert handshakes.attempts == 1


RecordingConnection = EchoConnection  # (it records each Round too)


def test_a_flush_sends_the_queued_releases_in_a_round_that_drafts_nothing():
    """The engine detaching the drafter sends no Round for a while: the releases it queued go at once."""
    with HiddenRing.create(64, 4, "float32") as ring:
        client = DrafterClient("127.0.0.1:1", ring, pb.TargetInfo(), deadline_s=1.0)
        conn = client._conn = RecordingConnection()
        ring.begin_round(client._seq)
        client.extend([("a", [1, 2], torch.zeros(2, 4)), ("b", [3], torch.zeros(1, 4))])
        client.draft([], None)  # both extended on the drafter
        client.release("a")
        client.release("b")
        sent = len(conn.rounds)
        client.flush()
        assert len(conn.rounds) == sent + 1
        assert list(conn.rounds[-1].release) == ["a", "b"] and not conn.rounds[-1].draft
        assert client._pending_release == []
        client._conn = None
        client.flush()  # the drafter away: nothing to send, no error


def test_requests_starting_on_long_prefixes_go_out_in_rounds_of_bounded_size():
    """attach_prefix's tokens ride on a request's next extend: many requests starting on long prefixes at once (a burst
    on a cached document, requests joining after a detached period) go out in several Rounds, none carrying more than
    FLUSH_PREFIX_TOKENS prefix tokens beyond its first request's, and none is lost."""
    with HiddenRing.create(64, 4, "float32") as ring:
        client = DrafterClient("127.0.0.1:1", ring, pb.TargetInfo(), deadline_s=1.0)
        client.FLUSH_PREFIX_TOKENS = 1000
        conn = client._conn = EchoConnection()
        ring.begin_round(client._seq)
        for i in range(10):
            client.attach_prefix(f"req-{i}", list(range(400)))
        client.extend([(f"req-{i}", [1], torch.zeros(1, 4)) for i in range(10)])
        client.draft([], None)
        sizes = [sum(len(e.prefix.token_ids) for e in r.extend) for r in conn.rounds]
        assert sum(sizes) == 4000 and max(sizes) <= 1000 and len(sizes) == 5, sizes
        assert [e.request_id for r in conn.rounds for e in r.extend] == [f"req-{i}" for i in range(10)]
