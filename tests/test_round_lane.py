"""The round lane's socket protocol on its own: the handshake token, framing, deadlines, a peer that
goes away, and the drafter's fallback to the stream when the offered address cannot be reached."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from tandem.round_lane import LANE_SUPPORTED, MAX_FRAME_BYTES, AsyncLane, LaneError, LaneListener

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
        assert lane.exchange(payload, 5.0) == payload[::-1]
    done.result(5)
    lane.close()
    assert peer.run(far.receive()) is None  # the far end sees the close as the end of the lane
    far.close()


def test_a_peer_without_the_token_is_refused(peer):
    listener = LaneListener()
    pending = peer.submit(AsyncLane.connect(listener.address, b"not the token"))
    with pytest.raises(LaneError, match="did not read our Hello"):
        listener.accept(5.0)
    pending.result(5).close()
    listener.close()


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
        lane.exchange(b"round", 0.2)
    assert 0.15 < time.monotonic() - started < 2.0
    far.close()
    started = time.monotonic()
    with pytest.raises(LaneError):
        lane.exchange(b"round", 5.0)  # closed: no waiting for the deadline
    assert time.monotonic() - started < 1.0
    lane.close()


def test_an_announced_frame_over_the_limit_is_refused(peer):
    lane, far = connected(peer)

    async def announce_huge():
        await peer.loop.sock_sendall(far._sock, (MAX_FRAME_BYTES + 1).to_bytes(4, "little"))

    peer.run(announce_huge())
    with pytest.raises(LaneError, match="the peer is broken"):
        lane.receive(5.0)
    with pytest.raises(LaneError, match="exceeds"):
        lane.send(b"\0" * (MAX_FRAME_BYTES + 1))
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
    a, b = LaneListener(), LaneListener()
    try:
        assert a.address.startswith("@") and a.address != b.address and a.token != b.token
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with pytest.raises(OSError):  # abstract: no file on disk to connect by
            probe.connect(a.address[1:])
        probe.close()
    finally:
        a.close()
        b.close()
