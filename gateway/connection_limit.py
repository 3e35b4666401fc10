"""At most ``--max-connections-per-address`` open REST connections a client: past it a connection gets a 429 and is
closed before anything it sent is read, so that one client cannot take the file descriptors every other client needs.
Mixed into the gateway's uvicorn protocol (gateway/http_protocol.py), each server's class with a table of its own."""

from __future__ import annotations

import collections
import ipaddress
import json
import logging

from tandem.log_limit import LimitedLog

log = LimitedLog(logging.getLogger("gateway"))

# A refused connection drops what its client sends for at most this long after the 429, until the client closes: closed
# with unread bytes, the kernel resets it and the client reads a reset instead of the answer. At most LINGER_MAX of a
# client's refused connections linger so; past them one is closed at once (a client that keeps opening would otherwise
# hold as many descriptors as it opens in LINGER_S).
LINGER_S = 2.0
LINGER_MAX = 8
_REFUSAL = json.dumps({"error": {
    "message": "too many open connections from this address (--max-connections-per-address)",
    "type": "rate_limit_error", "code": 429}}).encode()
TOO_MANY_CONNECTIONS = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(_REFUSAL), _REFUSAL))


def client_key(peer) -> str | None:
    """What a connection counts against: its peer's IPv4 address, or the /64 of its IPv6 address (one host commonly
    holds a whole /64; an IPv4-mapped address counts as the IPv4 one); None for a peer without one (a Unix socket)."""
    if not isinstance(peer, tuple) or not peer or not isinstance(peer[0], str):
        return None
    host = peer[0]
    if ":" not in host:
        return host
    address = ipaddress.IPv6Address(host.split("%")[0])
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network((address, 64), strict=False))


class PerAddressLimit:
    """Mixed into a uvicorn HTTP protocol ahead of it (``per_address``, ``_open`` and ``_lingering`` set by its class:
    gateway/http_protocol.py)."""

    per_address = 0  # connections one client may hold; 0: no limit
    _open: collections.Counter  # open connections by client_key, one table per server's class
    _lingering: collections.Counter  # refused connections lingering, by client_key (the same)
    _counted = None  # the client_key this connection is counted against
    _linger = None  # a refused connection's abort timer
    _lingers_for = None  # the client_key a lingering refused connection is counted against

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        key = client_key(transport.get_extra_info("peername")) if self.per_address else None
        if key is None:
            return
        if self._open[key] >= self.per_address:
            log.warning(("connections", key), "refused a connection from %s: it holds %d already "
                        "(--max-connections-per-address)", key, self._open[key])
            transport.write(TOO_MANY_CONNECTIONS)
            if self._lingering[key] >= LINGER_MAX:
                transport.close()
                return
            if transport.can_write_eof():
                transport.write_eof()
            self._linger = self.loop.call_later(LINGER_S, transport.abort)
            self._lingering[key] += 1
            self._lingers_for = key
            return
        self._open[key] += 1
        self._counted = key

    def data_received(self, data: bytes) -> None:
        if self._linger is None:  # (a refused connection's bytes are dropped unread by the server)
            super().data_received(data)

    def eof_received(self):
        if self._linger is not None:
            self.transport.close()  # (the client read its answer and closed: nothing unread is left)
            return False
        return super().eof_received()

    def connection_lost(self, exc) -> None:
        if self._linger is not None:
            self._linger.cancel()
        for table, key in ((self._open, self._counted), (self._lingering, self._lingers_for)):
            if key is not None:
                table[key] -= 1
                if not table[key]:
                    del table[key]  # (clients come and go: the tables hold only those with connections)
        super().connection_lost(exc)
