"""DrafterClient: the engine's Proposer, backed by the drafter service over one bidirectional stream.

``extend`` writes features into the shared-memory ring and queues the offsets; ``release`` queues a
request id; ``draft`` sends everything queued plus the draft requests as one Round and waits for that
round's Drafts — one message each way per round, on the round lane (a local socket agreed on at
handshake, tandem/round_lane.py) when the drafter could attach to it, else on the stream. The reply
frees the round's ring rows.

The drafter is optional at every moment. While it is absent ``available`` is False and the engine
decodes plainly; a reply later than the deadline, a broken stream or a dead process raises
ProposerUnavailable (the engine then drops all draft state) and a background thread reconnects.
The drafter starts every connection empty, so nothing from before a loss is ever referenced again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable

import grpc
import torch
from google.protobuf.message import DecodeError

from tandem.errors import TandemError
from tandem.ring import HiddenRing
from tandem.round_lane import LANE_SUPPORTED, BlockingLane, LaneError, LaneListener
from tandem.rpc.drafter.v1 import drafter_pb2 as pb
from tandem.rpc.drafter.v1 import drafter_pb2_grpc as pb_grpc
from tandem.speculative.tree import DraftTree
from tandem.speculative.verify import ProposerUnavailable

log = logging.getLogger("verifier.drafter_client")
PROTOCOL_VERSION = 1
LANE_ACCEPT_S = 1.0


class _Connection:
    """One live stream, driven by whichever thread calls (the engine thread, under the client's lock):
    each write and read runs on the client's private asyncio loop in the caller's thread, so a round
    costs no hand-off to a gRPC iterator thread or a reader thread (the boundary's main price). The
    loop outlives connections and is never closed: gRPC may still deliver a late event of a closed
    stream to it. With a round lane, the rounds bypass the loop: blocking socket calls on the
    caller's thread."""

    def __init__(self, address: str, hello: pb.VerifierMessage, timeout_s: float, loop: asyncio.AbstractEventLoop,
                 loop_lock: threading.Lock, offer_lane: bool):
        self.loop, self.loop_lock = loop, loop_lock
        self.channel = self.call = None
        self.lane: BlockingLane | None = None
        listener = _listen() if offer_lane and LANE_SUPPORTED else None
        try:
            if listener is not None:  # this connection's own lane address and token
                offer = pb.VerifierMessage()
                offer.CopyFrom(hello)
                offer.hello.round_lane, offer.hello.round_lane_token = listener.address, listener.token
                hello = offer
            self._run(self._open(address))
            self.send(hello)
            welcome = self.receive(timeout_s)
            if not welcome.HasField("welcome"):
                raise ProposerUnavailable("the drafter did not answer the handshake with a Welcome")
            if welcome.welcome.round_lane:
                if listener is None:
                    raise ProposerUnavailable("the drafter answered with a round lane this verifier did not offer")
                try:  # the drafter connected before it sent the Welcome: the accept is immediate
                    self.lane = listener.accept(LANE_ACCEPT_S)
                except LaneError as e:
                    raise ProposerUnavailable(str(e)) from None
        except ProposerUnavailable:
            self.close()
            raise
        finally:
            if listener is not None:
                listener.close()
        self.welcome = welcome.welcome

    async def _open(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_permit_without_calls", 1)])
        self.call = pb_grpc.DrafterStub(self.channel).Rounds()

    def _run(self, coro, timeout_s: float | None = None):
        # The loop is busy only while another thread closes an old stream; never wait on it for long.
        if not self.loop_lock.acquire(timeout=max(timeout_s or 0.0, 5.0)):
            coro.close()
            raise ProposerUnavailable("the drafter stream's event loop is busy closing an old stream")
        try:
            try:
                return self.loop.run_until_complete(asyncio.wait_for(coro, timeout_s))
            finally:
                self.loop_lock.release()
        except asyncio.TimeoutError:
            raise ProposerUnavailable(f"the drafter did not reply within {timeout_s * 1000:.0f} ms") from None
        except grpc.RpcError as e:
            error = ProposerUnavailable(f"drafter stream failed: {e.code().name}: {e.details()}")
            error.status, error.details = e.code(), e.details()
            raise error from None
        except (asyncio.InvalidStateError, asyncio.CancelledError, ConnectionError) as e:  # the stream is gone
            raise ProposerUnavailable(f"drafter stream failed: {type(e).__name__}: {e}") from None

    def send(self, message: pb.VerifierMessage) -> None:
        self._run(self.call.write(message))

    def receive(self, timeout_s: float) -> pb.DrafterMessage:
        return self._checked(self._run(self.call.read(), timeout_s))

    def exchange(self, message: pb.VerifierMessage, timeout_s: float) -> pb.DrafterMessage:
        """Send one message and read the reply: on the round lane when there is one, else in one pass
        of the loop over the stream (a round's whole boundary)."""
        if self.lane is not None:
            try:
                return pb.DrafterMessage.FromString(self.lane.exchange(message.SerializeToString(), timeout_s))
            except LaneError as e:
                raise ProposerUnavailable(str(e)) from None
            except DecodeError as e:
                raise ProposerUnavailable(f"the drafter sent an unreadable message on the round lane: {e}") from None

        async def write_then_read():
            await self.call.write(message)
            return await self.call.read()

        return self._checked(self._run(write_then_read(), timeout_s))

    @staticmethod
    def _checked(message) -> pb.DrafterMessage:
        if message is grpc.aio.EOF:
            raise ProposerUnavailable("the drafter closed the stream")
        return message

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()  # the drafter sees the lane end at once, whatever the stream does

        async def shut():
            if self.call is not None:
                self.call.cancel()
            if self.channel is not None:
                await self.channel.close()

        def run() -> None:
            try:
                self._run(shut(), 5.0)
            except Exception as e:  # noqa: BLE001 - closing a broken stream must not fail the caller
                log.debug("closing the drafter stream: %s", e)

        # The caller may be running an event loop of its own (the service's shutdown): close on a helper thread.
        closer = threading.Thread(target=run, name="drafter-close", daemon=True)
        closer.start()
        closer.join(5.0)


def _listen() -> LaneListener | None:
    """A round lane to offer, or None (rounds on the stream) where this process cannot open one."""
    try:
        return LaneListener()
    except OSError as e:  # a sandbox without AF_UNIX, no file descriptors left
        log.info("no round lane (%s); rounds go on the gRPC stream", e)
        return None


class DrafterClient:
    FLUSH_ROWS = 4096  # pending extend rows that trigger an extend-only round

    def __init__(self, address: str, ring: HiddenRing, target: pb.TargetInfo, deadline_s: float,
                 reconnect_interval_s: float = 1.0, on_state: Callable[[bool], None] = lambda up: None,
                 on_round: Callable[[float, float], None] = lambda round_trip_s, drafter_s: None,
                 round_lane: bool = True):
        self.address, self.ring, self.target = address, ring, target
        self.round_lane = round_lane  # offer the drafter a local socket for the rounds (tandem/round_lane.py)
        self.deadline_s, self.reconnect_interval_s = deadline_s, reconnect_interval_s
        self.on_state, self.on_round = on_state, on_round
        self._lock = threading.Lock()
        self._conn: _Connection | None = None
        self._seq = 0
        self._pending_extend: list[pb.Extend] = []
        self._pending_release: list[str] = []
        self._traces: dict[str, dict[str, str]] = {}
        self._stop = threading.Event()
        self._last_refusal = ""
        self._reconnector = threading.Thread(target=self._keep_connected, name="drafter-connect", daemon=True)
        self._loop, self._loop_lock = asyncio.new_event_loop(), threading.Lock()  # shared by every connection

    # -- connection ------------------------------------------------------------------------------
    def start(self) -> None:
        self._reconnector.start()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._drop("shutting down")

    @property
    def available(self) -> bool:
        return self._conn is not None

    def wait_connected(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.available:
                return True
            time.sleep(0.05)
        return self.available

    def _keep_connected(self) -> None:
        hello = pb.VerifierMessage(hello=pb.Hello(protocol_version=PROTOCOL_VERSION,
                                                   ring=pb.RingSpec(**self.ring.spec.to_fields()), target=self.target))
        while not self._stop.is_set():
            if self._conn is None:
                try:
                    conn = _Connection(self.address, hello, max(self.deadline_s, 5.0), self._loop, self._loop_lock,
                                       self.round_lane)
                except Exception as e:  # noqa: BLE001 - this thread must outlive any failed attempt
                    if not isinstance(e, ProposerUnavailable):
                        log.warning("connecting to the drafter at %s failed: %s: %s", self.address, type(e).__name__, e)
                    details = getattr(e, "details", "")
                    if getattr(e, "status", None) == grpc.StatusCode.FAILED_PRECONDITION:  # misconfigured: say it once
                        if details != self._last_refusal:
                            log.error("the drafter at %s refused this verifier: %s", self.address, details)
                        self._last_refusal = details
                    else:
                        log.debug("drafter at %s not reachable: %s", self.address, e)
                else:
                    with self._lock:
                        if self._stop.is_set():  # closed while the handshake ran
                            conn.close()
                            return
                        self._conn, self._seq = conn, self._seq + 1
                        self._pending_extend.clear()
                        self._pending_release.clear()
                        self.ring.begin_round(self._seq)
                    log.info("connected to the drafter at %s (%s); rounds on %s", self.address, conn.welcome.draft_model,
                             "the round lane" if conn.lane is not None else "the gRPC stream")
                    self.on_state(True)
            self._stop.wait(self.reconnect_interval_s)

    def _drop(self, reason: str) -> None:
        """Forget the connection and everything in flight (called with the lock held)."""
        if self._conn is None:
            return
        log.warning("lost the drafter: %s; decoding without speculation until it is back", reason)
        conn, self._conn = self._conn, None
        conn.close()
        self.ring.release_all()
        self._pending_extend.clear()
        self._pending_release.clear()
        self.on_state(False)

    # -- Proposer --------------------------------------------------------------------------------
    def note_trace(self, rid: str, carrier: dict[str, str]) -> None:
        """The request's W3C trace context, so the drafter's spans join the request's trace."""
        if carrier:
            self._traces[rid] = carrier

    def extend(self, items: list[tuple[str, list[int], torch.Tensor]]) -> None:
        # One request's rows go in pieces of at most FLUSH_ROWS (consecutive extends, applied in order),
        # so that no single item — a long prompt — needs more of the ring than a round may hold.
        pieces = [(rid, tokens[i : i + self.FLUSH_ROWS], features[i : i + self.FLUSH_ROWS])
                  for rid, tokens, features in items for i in range(0, len(tokens), self.FLUSH_ROWS)]
        queued = sum(e.ring_rows for e in self._pending_extend)
        for rid, tokens, features in pieces:
            # Queued extends go out with the next draft; past FLUSH_ROWS they go first in an extend-only
            # round, so that many at once (prefills, catch-ups of held plain steps) cannot fill the ring.
            if queued and queued + features.shape[0] > self.FLUSH_ROWS:
                self.draft([], None)
                queued = 0
            with self._lock:
                if self._conn is None:
                    raise ProposerUnavailable("the drafter is not connected")
                try:
                    offset = self.ring.allocate(features.shape[0])
                    self.ring.write(offset, features)
                except TandemError as e:  # the ring is full: the drafter is far behind
                    self._drop(str(e))
                    raise ProposerUnavailable(str(e)) from e
                self._pending_extend.append(pb.Extend(request_id=rid, token_ids=tokens, ring_offset=offset,
                                                      ring_rows=features.shape[0]))
            queued += features.shape[0]

    def release(self, rid: str) -> None:
        self._traces.pop(rid, None)
        with self._lock:
            if self._conn is not None:
                self._pending_release.append(rid)

    def draft(self, rids: list[str], spec) -> list[DraftTree]:
        with self._lock:
            conn = self._conn
            if conn is None:
                raise ProposerUnavailable("the drafter is not connected")
            params = (pb.SpecParams(num_steps=spec.num_steps, topk=spec.topk, num_draft_tokens=spec.num_draft_tokens)
                      if spec is not None else None)
            seq = self._seq
            round_msg = pb.Round(seq=seq, release=self._pending_release, extend=self._pending_extend,
                                 draft=[pb.DraftRequest(request_id=r, spec=params, trace_context=self._traces.get(r, {}))
                                        for r in rids])
            self._pending_extend, self._pending_release = [], []
            self._seq += 1
            self.ring.begin_round(self._seq)
            self.ring.publish()
            sent = time.perf_counter()
            try:
                reply = conn.exchange(pb.VerifierMessage(round=round_msg), self.deadline_s)
                if not reply.HasField("drafts") or reply.drafts.seq != seq:
                    raise ProposerUnavailable(f"the drafter answered round {seq} out of order")
            except ProposerUnavailable as e:
                self._drop(str(e))
                raise
            self.ring.release(seq)
        self.on_round(time.perf_counter() - sent, reply.drafts.draft_seconds)
        trees = {t.request_id: t for t in reply.drafts.trees}
        missing = [r for r in rids if r not in trees]
        if missing:  # a broken reply: start over on a fresh stream (the drafter then forgets every request)
            with self._lock:
                self._drop(f"the drafter returned no tree for {missing[0]}")
            raise ProposerUnavailable(f"the drafter returned no tree for {missing[0]}")
        return [DraftTree(list(trees[r].token_ids), list(trees[r].parents), list(trees[r].scores)) for r in rids]
