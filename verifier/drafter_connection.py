"""The verifier's end of one drafter connection: the gRPC Rounds stream (handshake, lifeline, and the
rounds' fallback transport) and, when the drafter attached to it, the round lane (tandem/round_lane.py).
Failures of either are ProposerUnavailable; DrafterClient (verifier/drafter_client.py) then drops the
connection and its DrafterReconnector (verifier/drafter_reconnect.py) opens another."""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
from google.protobuf.message import DecodeError

from tandem.round_lane import LANE_SUPPORTED, BlockingLane, LaneError, LaneListener
from tandem.rpc.drafter.v1 import drafter_pb2 as pb
from tandem.rpc.drafter.v1 import drafter_pb2_grpc as pb_grpc
from tandem.speculative.proposer import ProposerUnavailable

log = logging.getLogger("verifier.drafter_client")
LANE_ACCEPT_S = 1.0


class DrafterConnection:
    """One live stream, driven by whichever thread calls (the engine thread, under the client's lock):
    each write and read runs on the client's private asyncio loop in the caller's thread, so a round
    costs no hand-off to a gRPC iterator thread or a reader thread (the boundary's main price). The
    loop outlives connections and is never closed: gRPC may still deliver a late event of a closed
    stream to it. With a round lane, the rounds bypass the loop: blocking socket calls on the
    caller's thread."""

    def __init__(self, address: str, hello: pb.VerifierMessage, timeout_s: float, loop: asyncio.AbstractEventLoop,
                 loop_lock: threading.Lock, offer_lane: bool, metadata: tuple = ()):
        """``metadata``: the stream's call metadata (the internal secret, tandem.internal_secret)."""
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
            self._run(self._open(address, metadata))
            self.send(hello)
            welcome = self.receive(timeout_s)
            if not welcome.HasField("welcome"):
                raise ProposerUnavailable("the drafter did not answer the handshake with a Welcome")
            spoken = hello.hello.protocol_version
            if welcome.welcome.protocol_version != spoken:
                error = ProposerUnavailable(f"it speaks drafter protocol {welcome.welcome.protocol_version}, this "
                                            f"verifier {spoken}: run the same Tandem version on both")
                error.status, error.details = grpc.StatusCode.FAILED_PRECONDITION, str(error)
                raise error
            if welcome.welcome.round_lane:
                if listener is None:
                    raise ProposerUnavailable("the drafter answered with a round lane this verifier did not offer")
                try:  # the drafter connected before it sent the Welcome: the accept is immediate
                    self.lane = listener.accept(LANE_ACCEPT_S)
                except LaneError as e:
                    raise LaneNotJoined(str(e)) from None
        except ProposerUnavailable:
            self.close()
            raise
        finally:
            if listener is not None:
                listener.close()
        self.welcome = welcome.welcome

    async def _open(self, address: str, metadata: tuple) -> None:
        # A frozen drafter (stopped, swapping) surfaces within ~15 s even while no round is asked of it (the policy
        # plain): its up metric and the attachment's next round see it gone (30 s without a ping timeout: ~50 s).
        # The drafter takes pings every 10 s (drafter/serve.py).
        self.channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.http2.ping_timeout_ms", 5_000), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)])  # (gRPC's default 2 stops the pings of an idle stream)
        self.call = pb_grpc.DrafterStub(self.channel).Rounds(metadata=metadata or None)

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

    def send_round(self, message: pb.VerifierMessage, timeout_s: float) -> None:
        """Send a Round: on the round lane when there is one, else on the stream."""
        if self.lane is None:
            return self._run(self.call.write(message), timeout_s)
        try:
            self.lane.send(message.SerializeToString(), timeout_s)
        except LaneError as e:
            raise ProposerUnavailable(str(e)) from None

    def receive_round(self, timeout_s: float) -> pb.DrafterMessage:
        """The reply to the Round sent last, within ``timeout_s``."""
        if self.lane is None:
            return self.receive(timeout_s)
        try:
            return pb.DrafterMessage.FromString(self.lane.receive(timeout_s))
        except LaneError as e:
            raise ProposerUnavailable(str(e)) from None
        except DecodeError as e:
            raise ProposerUnavailable(f"the drafter sent an unreadable message on the round lane: {e}") from None

    def gone(self) -> bool:
        """Whether the drafter's end has gone, seen without sending anything (asked between rounds, when none may be
        sent for a while: a drafter detached by the policy): its round lane closed where it has one (the drafter's
        process holds both ends), else its stream ended."""
        if self.lane is not None:
            return self.lane.peer_closed()
        if not self.loop_lock.acquire(blocking=False):
            return False  # (the loop busy closing an old stream: asked again at the next look, never waited for)
        try:
            self.loop.run_until_complete(asyncio.sleep(0))  # (the stream's events are taken in only while it runs)
        finally:
            self.loop_lock.release()
        return self.call is None or self.call.done()

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


class LaneNotJoined(ProposerUnavailable):
    """The drafter said it joined the offered round lane and no connection of its came (one of another user, or
    without the lane's token, is dropped: a drafter running as another user in the same network namespace)."""


def _listen() -> LaneListener | None:
    """A round lane to offer, or None (rounds on the stream) where this process cannot open one."""
    try:
        return LaneListener()
    except OSError as e:  # a sandbox without AF_UNIX, no file descriptors left
        log.info("no round lane (%s); rounds go on the gRPC stream", e)
        return None
