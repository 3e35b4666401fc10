"""The round lane's socket protocol on its own: the handshake token, framing, deadlines, a peer that
goes away, and the drafter's fallback to the stream when the offered address cannot be reached."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from tandem.round_lane import LANE_SUPPORTED, MAX_FRAME_BYTES, AsyncLane, LaneError, LaneListener
from tandem.rpc.drafter.v1 import PROTOCOL_VERSION

pytestmark = pytest.mark.skipif(not LANE_SUPPORTED, reason="abstract Unix sockets are Linux-only")


class AsyncPeer:
    """The drafter's end on an event loop of its own thread; ``run`` executes a coroutine there."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def peer():
    p = AsyncPeer()
    yield p
    p.close()


def exchange(lane, payload: bytes, timeout_s: float) -> bytes:
    """A Round and its reply, as the verifier's connection sends and reads them."""
    lane.send(payload, timeout_s)
    return lane.receive(timeout_s)


def connected(peer: AsyncPeer):
    listener = LaneListener()
    pending = peer.submit(AsyncLane.connect(listener.address, listener.token))
    lane = listener.accept(5.0)
    listener.close()
    return lane, pending.result(5)


def test_frames_go_both_ways_in_order_whatever_their_size(peer):
    lane, far = connected(peer)

    async def echo(n):
        for _ in range(n):
            frame = await far.receive()
            await far.send(frame[::-1])

    done = peer.submit(echo(4))
    for payload in (b"", b"x", bytes(range(256)) * 3, b"y" * (1 << 20)):  # empty, tiny, odd, 1 MiB (several reads)
        assert exchange(lane, payload, 5.0) == payload[::-1]
    done.result(5)
    lane.close()
    assert peer.run(far.receive()) is None  # the far end sees the close as the end of the lane
    far.close()


def test_a_peer_without_the_token_is_dropped_and_the_drafter_accepted_after_it(peer, caplog):
    """A local process connecting first (the address is listed in /proc/net/unix) kept speculation off: it is
    dropped, and the drafter that connects next is accepted."""
    listener = LaneListener()
    intruder = peer.submit(AsyncLane.connect(listener.address, b"not the token")).result(5)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # (connects and says nothing)
    silent.connect(b"\0" + listener.address[1:].encode())
    drafter = peer.submit(AsyncLane.connect(listener.address, listener.token))
    with caplog.at_level("WARNING", logger="tandem.round_lane"):
        lane = listener.accept(0.2)  # (shorter than the silent peer's wait: the drafter queued behind it still counts)
    assert "did not read our Hello" in caplog.text and "sent no token" in caplog.text
    exchange_done = peer.submit(_echo_once(drafter.result(5)))
    assert exchange(lane, b"round", 5.0) == b"round"
    exchange_done.result(5)
    for end in (intruder, lane):
        end.close()
    silent.close()
    listener.close()


def test_a_peer_without_the_token_alone_is_no_drafter(peer):
    listener = LaneListener()
    pending = peer.submit(AsyncLane.connect(listener.address, b"not the token"))
    with pytest.raises(LaneError, match=r"did not connect to the round lane.*\(1 other connection\(s\) dropped\)"):
        listener.accept(1.0)
    pending.result(5).close()
    listener.close()


async def _echo_once(far):
    await far.send(await far.receive())


def test_nobody_connecting_is_an_error_within_the_deadline():
    listener = LaneListener()
    started = time.monotonic()
    with pytest.raises(LaneError, match="did not connect"):
        listener.accept(0.2)
    assert time.monotonic() - started < 2.0
    listener.close()


def test_a_silent_peer_times_out_and_a_closed_one_fails_at_once(peer):
    lane, far = connected(peer)
    started = time.monotonic()
    with pytest.raises(LaneError, match="within 200 ms"):
        exchange(lane, b"round", 0.2)
    assert 0.15 < time.monotonic() - started < 2.0
    far.close()
    started = time.monotonic()
    with pytest.raises(LaneError):
        exchange(lane, b"round", 5.0)  # closed: no waiting for the deadline
    assert time.monotonic() - started < 1.0
    lane.close()


def test_a_closed_peer_is_seen_between_rounds_without_sending(peer):
    lane, far = connected(peer)
    assert not lane.peer_closed()
    peer.submit(far.send(b"reply")).result(5)  # a frame waiting to be read: alive
    time.sleep(0.05)
    assert not lane.peer_closed() and lane.receive(1.0) == b"reply"
    far.close()
    deadline = time.monotonic() + 5
    while not lane.peer_closed() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lane.peer_closed()
    lane.close()


def test_a_peer_that_stops_reading_cannot_hold_the_sender_past_its_deadline(peer):
    lane, far = connected(peer)  # far never reads: a big frame fills the socket buffers
    started = time.monotonic()
    with pytest.raises(LaneError, match="within 200 ms"):
        exchange(lane, b"x" * (16 << 20), 0.2)
    assert time.monotonic() - started < 2.0
    lane.close()
    far.close()


def test_an_announced_frame_over_the_limit_is_refused(peer):
    lane, far = connected(peer)

    async def announce_huge():
        await peer.loop.sock_sendall(far._sock, (MAX_FRAME_BYTES + 1).to_bytes(4, "little"))

    peer.run(announce_huge())
    with pytest.raises(LaneError, match="the peer is broken"):
        lane.receive(5.0)
    with pytest.raises(LaneError, match="exceeds"):
        lane.send(b"\0" * (MAX_FRAME_BYTES + 1), 1.0)
    lane.close()
    far.close()


def test_an_unreachable_lane_leaves_the_drafter_on_the_stream(peer):
    from drafter.service import _attach_lane
    from tandem.rpc.drafter.v1 import drafter_pb2 as pb

    listener = LaneListener()
    address = listener.address
    listener.close()  # nobody listens there any more (as from another network namespace)
    assert peer.run(_attach_lane(pb.Hello(round_lane=address, round_lane_token=b"t"))) is None
    assert peer.run(_attach_lane(pb.Hello())) is None  # a verifier that offers no lane


def test_addresses_are_abstract_and_fresh():
    import os

    a, b = LaneListener(), LaneListener()
    try:
        assert a.address.startswith("@") and a.address != b.address and a.token != b.token
        assert not os.path.exists(a.address[1:])  # abstract: nothing on disk to leave behind
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(b"\0" + a.address[1:].encode())  # reachable by its abstract name
        probe.close()
    finally:
        a.close()
        b.close()


class LaneIgnoringDrafter:
    """A drafter service that answers the handshake without attaching to the offered lane (an older
    drafter, or one in another network namespace) — or, with ``claim``, says it attached but never
    connects (a lane it was offered: as a drafter whose connection the verifier drops, of another user) — and echoes
    every Round on the stream with an empty Drafts. ``expect_offer`` None: offers are not checked."""

    def __init__(self, claim: bool = False, expect_offer: bool | None = True, version: int = PROTOCOL_VERSION):
        self.claim, self.expect_offer, self.rounds, self.hellos = claim, expect_offer, 0, 0
        self.offers: list[bool] = []  # whether each hello offered a lane
        self.version = version

    def servicer(self):
        from tandem.rpc.drafter.v1 import drafter_pb2 as pb
        from tandem.rpc.drafter.v1 import drafter_pb2_grpc as pb_grpc

        fake = self

        class Servicer(pb_grpc.DrafterServicer):
            async def Rounds(self, requests, context):
                async for message in requests:
                    if message.HasField("hello"):
                        offered = message.hello.round_lane.startswith("@")
                        assert fake.expect_offer is None or offered == fake.expect_offer
                        fake.hellos += 1
                        fake.offers.append(offered)
                        yield pb.DrafterMessage(welcome=pb.Welcome(protocol_version=fake.version, draft_model="fake",
                                                                   round_lane=fake.claim and offered))
                    else:
                        fake.rounds += 1
                        yield pb.DrafterMessage(drafts=pb.Drafts(seq=message.round.seq))

        return Servicer()


def serve_fake(peer: AsyncPeer, fake: LaneIgnoringDrafter):
    import grpc

    from tandem.rpc.drafter.v1 import drafter_pb2_grpc as pb_grpc

    async def start():
        server = grpc.aio.server()
        pb_grpc.add_DrafterServicer_to_server(fake.servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    return peer.run(start())


def client_for(port: int, ring):
    from tandem.rpc.drafter.v1 import drafter_pb2 as pb
    from verifier.drafter_client import DrafterClient

    client = DrafterClient(f"127.0.0.1:{port}", ring, pb.TargetInfo(), deadline_s=1.0, reconnect_interval_s=0.2)
    client.start()
    return client


def test_a_drafter_that_declines_the_lane_gets_its_rounds_on_the_stream(peer):
    from tandem.ring import HiddenRing

    fake = LaneIgnoringDrafter()
    server, port = serve_fake(peer, fake)
    with HiddenRing.create(64, 4, "float32") as ring:
        client = client_for(port, ring)
        try:
            assert client.wait_connected(10.0)
            assert client._conn.lane is None
            assert client.draft([], None) == [] and fake.rounds == 1  # the round went over the stream
        finally:
            client.close()
    peer.run(server.stop(0))


def test_a_drafter_that_claims_the_lane_but_never_connects_gets_its_rounds_on_the_stream(peer, caplog):
    """(As a drafter of another user whose lane connection the verifier drops: speculation goes on, on the stream.)"""
    from tandem.ring import HiddenRing

    fake = LaneIgnoringDrafter(claim=True, expect_offer=None)
    server, port = serve_fake(peer, fake)
    with HiddenRing.create(64, 4, "float32") as ring:
        client = client_for(port, ring)
        try:
            assert client.wait_connected(10.0) and client._conn.lane is None
            assert fake.offers == [True, False]  # the claimed lane never joined: the next hello offers none
            assert client.draft([], None) == [] and fake.rounds == 1
            assert "said it joined the round lane and did not" in caplog.text
        finally:
            client.close()
    peer.run(server.stop(0))


def test_a_verifier_that_cannot_open_a_lane_keeps_its_rounds_on_the_stream(peer, monkeypatch):
    import verifier.drafter_connection as dc
    from tandem.ring import HiddenRing

    def no_sockets():
        raise OSError("AF_UNIX refused by the sandbox")

    monkeypatch.setattr(dc, "LaneListener", no_sockets)
    fake = LaneIgnoringDrafter(expect_offer=False)
    server, port = serve_fake(peer, fake)
    with HiddenRing.create(64, 4, "float32") as ring:
        client = client_for(port, ring)
        try:
            assert client.wait_connected(10.0) and client._conn.lane is None
            assert client.draft([], None) == [] and fake.rounds == 1
        finally:
            client.close()
    peer.run(server.stop(0))


class LaneRounds:
    """DrafterService's lane loop on its own: ``_round`` is replaced, so no model is needed."""

    def __init__(self, round_fn, busy_poll_s: float = 0.0):
        from drafter.profiling import RoundProfiler
        from drafter.service import DrafterService

        self.service = DrafterService.__new__(DrafterService)
        self.service._lock = None  # created on the peer's loop (below)
        self.service._generation = 1
        self.service._round = lambda message, ring, runs: (round_fn(message, ring), lambda: None)  # nothing after
        self.service.lane_busy_poll_s = busy_poll_s
        self.service.profiler = RoundProfiler(0, None)

    def start(self, peer: AsyncPeer):
        listener = LaneListener()

        async def attach():
            self.service._lock = asyncio.Lock()
            lane = await AsyncLane.connect(listener.address, listener.token)
            return asyncio.ensure_future(self.service._serve_lane(lane, ring=None, runs=None, generation=1))

        pending = peer.submit(attach())
        near = listener.accept(5.0)
        listener.close()
        return near, pending.result(5)


def done(peer: AsyncPeer, task) -> None:
    """Wait for a task of the peer's loop to end (the lane loop returns after closing its lane)."""
    async def wait():
        await asyncio.wait_for(task, 5.0)

    peer.run(wait())


def round_message(seq: int) -> bytes:
    from tandem.rpc.drafter.v1 import drafter_pb2 as pb

    return pb.VerifierMessage(round=pb.Round(seq=seq)).SerializeToString()


def test_the_drafters_lane_answers_rounds_and_closes_on_anything_else(peer):
    from tandem.rpc.drafter.v1 import drafter_pb2 as pb

    rounds = LaneRounds(lambda message, ring: pb.Drafts(seq=message.seq))
    near, task = rounds.start(peer)
    for seq in (3, 4):
        assert pb.DrafterMessage.FromString(exchange(near, round_message(seq), 5.0)).drafts.seq == seq
    hello = pb.VerifierMessage(hello=pb.Hello()).SerializeToString()  # not a Round: the lane ends
    with pytest.raises(LaneError, match="closed"):
        exchange(near, hello, 5.0)
    done(peer, task)
    near.close()


def test_a_busy_polling_drafter_answers_rounds_and_sees_the_lane_close(peer, monkeypatch):
    """--round-lane-busy-poll-ms: the lane loop spins for the next Round (here longer than the gaps
    between rounds and shorter than others), answers each, and still ends when the verifier closes."""
    from tandem.rpc.drafter.v1 import drafter_pb2 as pb

    spins = []  # (budget, whether a frame came within it)
    real_spin = AsyncLane.spin_until_readable
    monkeypatch.setattr(AsyncLane, "spin_until_readable",
                        lambda self, seconds: spins.append((seconds, real_spin(self, seconds))) or spins[-1][1])
    rounds = LaneRounds(lambda message, ring: pb.Drafts(seq=message.seq), busy_poll_s=0.05)
    near, task = rounds.start(peer)
    for seq, gap_s in ((1, 0.0), (2, 0.01), (3, 0.3)):  # within the spin, within it, past it (then it sleeps)
        time.sleep(gap_s)
        assert pb.DrafterMessage.FromString(exchange(near, round_message(seq), 5.0)).drafts.seq == seq
    near.close()
    done(peer, task)
    assert len(spins) == 4 and all(budget == 0.05 for budget, _ in spins)  # before each Round and the close
    assert spins[2][1] is False and spins[3][1] is True  # the 0.3 s gap outlasted a spin; the close ended one


def test_a_frame_that_already_arrived_is_read_even_with_no_time_left(peer):
    """The verifier may reach its read after the deadline (held up by the GIL): what already arrived is
    not a timeout; nothing there still is."""
    lane, far = connected(peer)
    peer.run(far.send(b"drafts"))
    time.sleep(0.05)
    assert lane.receive(0.0) == b"drafts"
    with pytest.raises(LaneError, match="no reply"):
        lane.receive(0.0)
    lane.close()
    far.close()


def test_spinning_for_a_frame_reports_whether_one_came(peer):
    lane, far = connected(peer)
    started = time.perf_counter()
    assert far.spin_until_readable(0.05) is False and time.perf_counter() - started >= 0.05
    lane.send(b"round", 5.0)
    assert far.spin_until_readable(5.0) is True and peer.run(far.receive()) == b"round"
    lane.close()
    assert far.spin_until_readable(5.0) is True and peer.run(far.receive()) is None  # a close is readable too
    far.close()


def test_a_failing_round_or_a_newer_stream_closes_the_lane(peer):
    def broken(message, ring):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    near, task = LaneRounds(broken).start(peer)
    with pytest.raises(LaneError, match="closed"):  # the verifier sees it at once, drops and reconnects
        exchange(near, round_message(1), 5.0)
    done(peer, task)
    near.close()

    from tandem.rpc.drafter.v1 import drafter_pb2 as pb

    rounds = LaneRounds(lambda message, ring: pb.Drafts(seq=message.seq))
    near, task = rounds.start(peer)
    rounds.service._generation = 2  # a newer verifier stream took over
    with pytest.raises(LaneError, match="closed"):
        exchange(near, round_message(1), 5.0)
    done(peer, task)
    near.close()


def test_the_drafter_packs_trees_in_the_rounds_order_across_heads_and_specs():
    """Requests are drafted in groups (per head and spec); the reply must list their trees in the order
    the Round asked for them, which is all the verifier matches them by."""
    from drafter.service import DrafterService
    from tandem.rpc.drafter.v1 import drafter_pb2 as pb
    from tandem.speculative.tree import DraftTree
    from tandem.speculative.tree_wire import unpack_trees

    class Head:
        def __init__(self, gen):
            self.gen = gen

        def draft(self, rids, spec):  # a chain whose tokens name the request, head and size
            n = spec.num_draft_tokens
            return [DraftTree([int(r[1:]) * 100 + self.gen * 10 + n] * n, list(range(-1, n - 1))) for r in rids]

    class Heads:
        def for_request(self, rid):
            return (int(rid[1:]) % 2, None)  # odd requests on the newer head

        def drafter(self, gen):
            return Head(gen)

    from drafter.metrics import DrafterMetrics

    service = DrafterService.__new__(DrafterService)
    service.heads = Heads()
    service.metrics = DrafterMetrics()
    sizes = {"r1": 4, "r2": 3, "r3": 4, "r4": 3, "r5": 2}
    round_msg = pb.Round(seq=7, draft=[pb.DraftRequest(request_id=r, spec=pb.SpecParams(num_steps=n - 1, topk=1,
                                                                                           num_draft_tokens=n))
                                       for r, n in sizes.items()])
    drafts, _ = service._round(round_msg, ring=None)
    trees = unpack_trees(drafts, len(sizes))
    assert [t.tokens[0] for t in trees] == [int(r[1:]) * 100 + (int(r[1:]) % 2) * 10 + n for r, n in sizes.items()]
    assert [t.size for t in trees] == list(sizes.values())


def test_a_drafter_speaking_another_protocol_is_refused(peer):
    from tandem.ring import HiddenRing

    fake = LaneIgnoringDrafter(version=1)  # e.g. a drafter of the previous release (a Tree message per tree)
    server, port = serve_fake(peer, fake)
    with HiddenRing.create(64, 4, "float32") as ring:
        client = client_for(port, ring)
        try:
            deadline = time.monotonic() + 10.0
            while fake.hellos < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert fake.hellos >= 2 and not client.available and fake.rounds == 0
            assert "drafter protocol 1" in client._reconnector.last_refusal  # said once, as an error
        finally:
            client.close()
    peer.run(server.stop(0))
