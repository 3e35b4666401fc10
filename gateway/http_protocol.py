"""The HTTP protocol the gateway's uvicorn runs: uvicorn's own (httptools where installed, else h11, as its ``auto``),
with two deadlines. uvicorn times out a connection only between requests (its keep-alive): one that never sends a
request, or trickles its headers a byte at a time, was held forever — a remote client opening a few thousand such
connections took the gateway's file descriptors, and with them REST, gRPC and /health. And a client that reads
nothing of its answer held the connection forever too (a close waits for the unsent bytes): one whose socket has
taken no bytes for the stream send timeout is cut. And one address may hold only so many connections at once
(``--max-connections-per-address``): past it a connection gets a 429 and is closed before anything of it is read, so
that one client cannot take the descriptors every other client needs."""

from __future__ import annotations

import collections
import importlib.util
import json
import logging

from gateway.admission import STREAM_SEND_TIMEOUT_S
from tandem.log_limit import LimitedLog

log = LimitedLog(logging.getLogger("gateway"))

REQUEST_HEAD_TIMEOUT_S = 15.0  # from a connection's first byte (or the last answer) to the end of a request's head
_REFUSAL = json.dumps({"error": {"message": "too many open connections from this address (--max-connections-per-address)",
                                  "type": "rate_limit_error", "code": 429}}).encode()
TOO_MANY_CONNECTIONS = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(_REFUSAL), _REFUSAL))


class _Deadlines:
    """Mixed into a uvicorn HTTP protocol: close the connection unless a request's head has arrived within
    ``head_timeout_s`` of its opening (or of the last byte after an answer); abort it when its writes have been
    paused (the client's window full) for ``stall_timeout_s``."""

    head_timeout_s = REQUEST_HEAD_TIMEOUT_S
    stall_timeout_s = STREAM_SEND_TIMEOUT_S
    per_address = 0  # connections one client address may hold; 0: no limit (http_protocol sets it)
    _open: collections.Counter  # open connections by client address, one table per server's class (http_protocol)
    _head_timer = None
    _stall_timer = None
    _address = None  # the client's address, once its connection is counted

    def _admit_address(self, transport) -> bool:
        """Count the connection against its client's address; over ``per_address`` answer 429 and close it."""
        if not self.per_address:
            return True
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) and peer else None  # (a Unix socket's peer has none)
        if address is None:
            return True
        if self._open[address] >= self.per_address:
            log.warning(("connections", address), "refused a connection from %s: it holds %d already "
                        "(--max-connections-per-address)", address, self._open[address])
            transport.write(TOO_MANY_CONNECTIONS)
            transport.close()
            return False
        self._open[address] += 1
        self._address = address
        return True

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        self._stall_timer = _cancelled(self._stall_timer)
        super().resume_writing()

    def _stalled(self) -> None:
        self._stall_timer = None
        self.transport.abort()  # (the stream's answer, waiting on the write, ends as a client gone)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if not self._admit_address(transport):
            return
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
        if self._address is not None:
            self._open[self._address] -= 1
            if not self._open[self._address]:
                del self._open[self._address]  # (addresses come and go: the table holds only those with connections)
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


def _cancelled(timer) -> None:
    """Cancel ``timer`` where there is one; None, for the attribute that held it."""
    if timer is not None:
        timer.cancel()
    return None


def http_protocol(per_address: int = 0) -> type:
    """The protocol class for ``uvicorn.Config(http=...)``, at most ``per_address`` connections a client address (0: no
    limit), counted in a table of its own."""
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return type(f"Deadlines{base.__name__}", (_Deadlines, base), {"per_address": per_address,
                                                                  "_open": collections.Counter()})
