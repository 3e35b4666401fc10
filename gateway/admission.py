"""What the gateway lets in before it does any work: a bounded number of generations in flight
(429 / RESOURCE_EXHAUSTED beyond it) and request bodies of bounded size (413, refused from the
Content-Length header or as soon as a chunked body passes the limit, never read whole first) that
arrive in bounded time (408: a client trickling its body would otherwise hold its connection forever), declared as JSON
(415 for another media type), from no other web origin (403): a web page can post text/plain, a form or a body with
no type to a server on localhost without a CORS preflight, and this server answers no preflight, so a browser's
request from another origin is never an API client's — refused, no site a user visits runs generations on their
server."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from starlette.requests import Request

from gateway.errors import GatewayError

# A client that takes none of a stream's bytes for this long is gone (REST and gRPC): it held its slots and its
# connection for as long as it kept the socket open, and 256 such streams refused everyone else (429)
STREAM_SEND_TIMEOUT_S = 60.0


class Slots:
    """Generations in flight, REST and gRPC together. Single event loop: no lock needed."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_use = 0

    def take(self) -> None:
        """Take a slot or raise 429; the caller must ``give_back()`` exactly once after a take."""
        if self.in_use >= self.limit:
            raise GatewayError(429, f"the server is at capacity ({self.limit} generations in flight: a request's n "
                                    "choices are n of them), retry later")
        self.in_use += 1

    def give_back(self) -> None:
        self.in_use -= 1


# Bodies being read at once hold at most this many bodies' worth of the largest allowed (slots are taken only after a
# body is read, so without it thousands of connections each sending megabytes held gigabytes; REST only: the gRPC
# port's are bounded by its RPCs, GRPC_EXTRA_RPCS)
BODY_BUDGET_BODIES = 16
# The gRPC port's RPCs in progress at once: the generations allowed plus this many (health checks and watches,
# reflection, generations being refused). Its messages arrive whole before a handler runs, so this is what bounds the
# memory they hold, (max_concurrent_requests + GRPC_EXTRA_RPCS) x max_body_bytes; past it, RESOURCE_EXHAUSTED before a
# message is read.
GRPC_EXTRA_RPCS = 64
GRPC_HEALTH_WATCHES = 16  # of those, health Watch streams (open without the API key, held for ever: gateway.grpc_api)


class BodyBudget:
    """Bytes of request bodies received and held while the rest comes, all connections together; a body that would
    pass ``limit`` gets 503 (retryable). Counted as the bytes arrive, never from a declared Content-Length: headers
    alone (a length announced, nothing sent) would fill it for free. Single event loop: no lock needed."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_use = 0

    def reserve(self, n: int) -> None:
        if self.in_use + n > self.limit:
            raise GatewayError(503, f"the server is receiving {self.limit} bytes of request bodies already, retry later")
        self.in_use += n

    def release(self, n: int) -> None:
        self.in_use -= n


async def read_body(request: Request, limit: int, timeout_s: float, budget: BodyBudget) -> bytes:
    h = request.headers
    _check_origin(h.get("origin"), [h.get("host"), *(h.get("x-forwarded-host") or "").split(",")])
    _check_media_type(request.headers.get("content-type"))
    held = [0]  # bytes of the budget this read holds, given back however it ends
    try:
        async with asyncio.timeout(timeout_s):
            return await _read(request, limit, budget, held)
    except TimeoutError:
        raise GatewayError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    finally:
        budget.release(held[0])


async def _read(request: Request, limit: int, budget: BodyBudget, held: list[int]) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise GatewayError(400, "the Content-Length header is not a number") from None
        if size > limit:
            raise _too_large(limit)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        budget.reserve(len(chunk))
        held[0] = size
        parts.append(chunk)
    return b"".join(parts)


def _check_origin(origin: str | None, hosts: list[str | None]) -> None:
    """A browser names the page's origin on a POST (``null`` from a file or a sandbox); clients that are not browsers
    send none. ``hosts``: the Host header, and those reverse proxies forwarded (a page served through them). Host
    names are compared, not ports: a proxy may forward the host without its port, and a page of this host on another
    port is no other site's (a DNS-rebinding page names this host too: the gateway keeps no allow-list of names)."""
    if origin is None:
        return
    names = {_hostname(f"//{h.strip()}") for h in hosts if h and h.strip()} - {None}
    if origin == "null" or _hostname(origin) not in names:
        raise GatewayError(403, f"requests from another web origin ({origin[:100]}) are refused: this server answers "
                                "no CORS preflight")


def _hostname(url: str) -> str | None:
    """The host name in ``url``; None where it has none or cannot be parsed (a malformed IPv6 literal: ``[::1``)."""
    try:
        return urlsplit(url).hostname
    except ValueError:
        return None


def _check_media_type(content_type: str | None) -> None:
    """JSON, or no Content-Type at all (a client that sends none is no browser's form)."""
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise GatewayError(415, f"the request body must be JSON (Content-Type: application/json), got {media!r}")


def _too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"the request body is larger than this server's limit of {limit} bytes")
