"""The round lane: a verifier's per-round messages to its co-located drafter over a Unix socket.

The drafter protocol has one message each way per round on the gRPC stream (docs/architecture.md, "One
speculative round"). That boundary has a fixed cost per round however small the messages
(bench/grpc_floor.py, bench/boundary.py): each message crosses gRPC's own threads and event-loop
wake-ups, a visible share of a speculative round. The round's messages are the same protobufs either way,
so the gRPC stream still opens every connection (Hello/Welcome: ring, target checks), stays open as the
connection's lifeline, and carries the rounds whenever no lane could be set up; the lane only moves each
Round and its Drafts to a local stream socket, length-prefixed.

Set-up, per connection: the verifier listens on a fresh abstract-namespace address (Linux; no file
is created, so none can be left behind) and names it with a random token in its Hello; the drafter
connects, sends the token as its first frame and says ``round_lane`` in its Welcome; the verifier
accepts and checks the token. A drafter that cannot connect (another network namespace, another OS)
or predates the lane leaves ``round_lane`` unset, and the rounds stay on the stream.

The verifier side blocks its engine thread on the socket (no event loop in between); the drafter side
reads on its asyncio loop, where its rounds already run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import select
import socket
import struct
import sys
import time

LANE_SUPPORTED = sys.platform.startswith("linux")  # abstract-namespace Unix sockets
HEADER = struct.Struct("<I")  # payload length, little-endian
MAX_FRAME_BYTES = 64 << 20  # a Round or Drafts is kilobytes; anything near this is a broken peer
# A peer's first frame (the token) within this, or it is dropped and the next one accepted: the drafter sends it as
# it connects, before its Welcome, so it is there when the verifier accepts
TOKEN_WAIT_S = 0.25

log = logging.getLogger("tandem.round_lane")


class LaneError(ConnectionError):
    """The lane failed: closed, timed out, or the peer spoke out of turn. The connection is over."""


def _sockaddr(address: str) -> bytes:
    if not address.startswith("@"):
        raise LaneError(f"round lane address {address!r}: expected an abstract address starting with '@'")
    return b"\0" + address[1:].encode()


def _frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise LaneError(f"round lane frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(payload)) + payload


class LaneListener:
    """The verifier's end before the drafter connects: a fresh address and the token to expect."""

    def __init__(self):
        self.address = f"@tandem-lane-{os.getpid()}-{secrets.token_hex(8)}"
        self.token = secrets.token_bytes(16)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(_sockaddr(self.address))
            self._sock.listen(8)
        except OSError:
            self._sock.close()
            raise

    def accept(self, timeout_s: float) -> "BlockingLane":
        """The drafter's connection, once its first frame proved it read our Hello. An abstract address has no
        permissions and is listed in /proc/net/unix: a peer of another user, or one without the token within
        TOKEN_WAIT_S, is dropped and the next one accepted (a local process connecting first kept speculation off)."""
        deadline = time.monotonic() + timeout_s
        dropped = 0
        while True:
            # (past the deadline, connections already queued are still taken: the drafter may wait behind others)
            self._sock.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                conn, _ = self._sock.accept()
            except OSError as e:  # socket.timeout is an OSError
                raise LaneError(f"the drafter did not connect to the round lane: {e}"
                                + (f" ({dropped} other connection(s) dropped)" if dropped else "")) from None
            lane = BlockingLane(conn)
            why = None if _same_user(conn) else "another user's process"
            if why is None:
                try:
                    token = lane.receive(TOKEN_WAIT_S)
                    why = None if secrets.compare_digest(token, self.token) else "a process that did not read our Hello"
                except LaneError as e:
                    why = f"a peer that sent no token ({e})"
            if why is None:
                return lane
            lane.close()
            dropped += 1
            log.warning("round lane: dropped %s; waiting for the drafter", why)

    def close(self) -> None:
        self._sock.close()


def _same_user(conn: socket.socket) -> bool:
    """Whether the peer runs as this process's user (or root), by the kernel's credentials of the connection."""
    try:
        _, uid, _ = struct.unpack("iII", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII")))
    except (OSError, AttributeError):  # (no SO_PEERCRED: not Linux, where the lane is not offered)
        return True
    return uid in (os.getuid(), 0)


class BlockingLane:
    """The verifier's end: blocking send and receive on the calling thread, with deadlines."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._header = bytearray(HEADER.size)

    def send(self, payload: bytes, timeout_s: float) -> None:
        frame = _frame(payload)
        try:
            self._sock.settimeout(timeout_s)
            self._sock.sendall(frame)
        except socket.timeout:
            raise LaneError(f"the peer did not take a round within {timeout_s * 1000:.0f} ms") from None
        except OSError as e:
            raise LaneError(f"round lane send failed: {e}") from None

    def peer_closed(self) -> bool:
        """Whether the peer has closed its end (asked between rounds, without waiting; a frame waiting to be read
        says it is alive)."""
        try:
            self._sock.settimeout(0.0)  # (each send and receive sets its own deadline again)
            return self._sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def receive(self, timeout_s: float) -> bytes:
        """The next frame within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._read_into(memoryview(self._header), deadline, timeout_s)
        (size,) = HEADER.unpack(self._header)
        if size > MAX_FRAME_BYTES:
            raise LaneError(f"round lane frame of {size} bytes announced; the peer is broken")
        body = bytearray(size)
        self._read_into(memoryview(body), deadline, timeout_s)
        return bytes(body)

    def _read_into(self, view: memoryview, deadline: float, timeout_s: float) -> None:
        while view:
            # Past the deadline one read is still tried without waiting (timeout 0): bytes that arrived
            # while this thread was held up elsewhere (the GIL) are not a missed deadline.
            self._sock.settimeout(max(deadline - time.monotonic(), 0.0))
            try:
                n = self._sock.recv_into(view)
            except (socket.timeout, BlockingIOError):
                raise LaneError(f"no reply on the round lane within {timeout_s * 1000:.0f} ms") from None
            except OSError as e:
                raise LaneError(f"round lane receive failed: {e}") from None
            if n == 0:
                raise LaneError("the peer closed the round lane")
            view = view[n:]

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class AsyncLane:
    """The drafter's end: connects with the verifier's token, then frames on the running event loop."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)

    def spin_until_readable(self, seconds: float) -> bool:
        """Busy-poll for up to ``seconds``, blocking the calling thread (the event loop's); True once the
        verifier's next frame (or its close) is waiting. A core that spins between rounds takes the next
        Round without the scheduler's wake-up of a sleeping thread."""
        deadline = time.perf_counter() + seconds
        while not self._poller.poll(0):
            if time.perf_counter() >= deadline:
                return False
        return True

    @classmethod
    async def connect(cls, address: str, token: bytes) -> "AsyncLane":
        """Raise OSError (or LaneError) when the verifier's address cannot be reached from here."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, _sockaddr(address))
            lane = cls(sock)
            await lane.send(token)
        except BaseException:
            sock.close()
            raise
        return lane

    async def send(self, payload: bytes) -> None:
        await self._loop.sock_sendall(self._sock, _frame(payload))

    async def receive(self) -> bytes | None:
        """The next frame, or None once the verifier closed the lane."""
        header = await self._read(HEADER.size)
        if header is None:
            return None
        (size,) = HEADER.unpack(header)
        if size > MAX_FRAME_BYTES:
            raise LaneError(f"round lane frame of {size} bytes announced; the peer is broken")
        body = await self._read(size)
        if body is None:
            raise LaneError("the verifier closed the round lane inside a frame")
        return body

    async def _read(self, size: int) -> bytes | None:
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            try:
                n = await self._loop.sock_recv_into(self._sock, view[got:])
            except ConnectionError:
                n = 0
            if n == 0:
                return None
            got += n
        return bytes(buf)

    def close(self) -> None:
        self._sock.close()
