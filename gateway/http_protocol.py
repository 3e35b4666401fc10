"""The HTTP protocol the gateway's uvicorn runs: uvicorn's own (httptools where installed, else h11, as its ``auto``),
with two deadlines. uvicorn times out a connection only between requests (its keep-alive): one that never sends a
request, or trickles its headers a byte at a time, was held forever — a remote client opening a few thousand such
connections took the gateway's file descriptors, and with them REST, gRPC and /health. And a client that reads
nothing of its answer held the connection forever too (a close waits for the unsent bytes): one whose socket has
taken no bytes for the stream send timeout is cut. And a client may hold only so many connections at once
(gateway/connection_limit.py)."""

from __future__ import annotations

import collections
import importlib.util
import logging

from gateway.admission import STREAM_SEND_TIMEOUT_S
from gateway.connection_limit import PerAddressLimit

log = logging.getLogger("gateway.http")
REQUEST_HEAD_TIMEOUT_S = 15.0  # from a connection's first byte (or the last answer) to the end of a request's head


class _Deadlines:
    """Mixed into a uvicorn HTTP protocol: close the connection unless a request's head has arrived within
    ``head_timeout_s`` of its opening (or of the last byte after an answer); abort it when its writes have been
    paused (the client's window full) for ``stall_timeout_s``."""

    head_timeout_s = REQUEST_HEAD_TIMEOUT_S
    stall_timeout_s = STREAM_SEND_TIMEOUT_S
    _head_timer = None
    _stall_timer = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        self._stall_timer = _cancelled(self._stall_timer)
        super().resume_writing()

    def _stalled(self) -> None:
        self._stall_timer = None
        # (the stream's answer, waiting on the write, then ends as a client gone: this line says why)
        log.warning("cut the connection from %s: it took none of its answer for %.0f s", _peer(self.transport),
                    self.stall_timeout_s)
        self.transport.abort()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            self._arm_head_timer()  # (after an answer: uvicorn's keep-alive timer is cancelled by these bytes)
        super().data_received(data)
        if not self._between_requests():  # a request's head is in
            self._head_timer = _cancelled(self._head_timer)

    def connection_lost(self, exc) -> None:
        self._head_timer = _cancelled(self._head_timer)
        self._stall_timer = _cancelled(self._stall_timer)
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_overdue)

    def _head_overdue(self) -> None:
        self._head_timer = None
        upgraded = self.transport.get_protocol() is not self  # (a websocket's: its own protocol now)
        if self._between_requests() and not upgraded and not self.transport.is_closing():
            self.transport.close()


def _peer(transport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "a client"


def _cancelled(timer) -> None:
    """Cancel ``timer`` where there is one; None, for the attribute that held it."""
    if timer is not None:
        timer.cancel()
    return None


def http_protocol(per_address: int = 0) -> type:
    """The protocol class for ``uvicorn.Config(http=...)``, at most ``per_address`` connections a client (0: no limit),
    counted in a table of its own."""
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return type(f"Deadlines{base.__name__}", (PerAddressLimit, _Deadlines, base),
                {"per_address": per_address, "_open": collections.Counter(), "_lingering": collections.Counter()})
