"""What the gateway lets in before it does any work: a bounded number of generations in flight (a REST request
beyond it waits its turn, first come first served, up to ``--max-queue-wait-s``, then 429, as vLLM's and SGLang's
servers queue what they cannot run yet; a gRPC call is refused at once, RESOURCE_EXHAUSTED: calls waiting would take the
gRPC port's few spare RPCs from its health checks) and request bodies of bounded size (413, refused from the
Content-Length header or as soon as a chunked body passes the limit, never read whole first) that
arrive in bounded time (408: a client trickling its body would otherwise hold its connection forever), declared as JSON
(415 for another media type), from no other web origin (403): a web page can post text/plain, a form or a body with
no type to a server on localhost without a CORS preflight, and this server answers no preflight, so a browser's
request from another origin is never an API client's — refused, no site a user visits runs generations on their
server."""

from __future__ import annotations

import asyncio
import collections
from urllib.parse import urlsplit

from starlette.requests import Request

from gateway.errors import GatewayError

# A client that takes none of a stream's bytes for this long is gone (REST and gRPC): it held its slots and its
# connection for as long as it kept the socket open, and 256 such streams refused everyone else (429)
STREAM_SEND_TIMEOUT_S = 60.0


class Slots:
    """Generations in flight, REST and gRPC together, and the REST requests waiting for theirs (in order). Single event
    loop: no lock needed."""

    def __init__(self, limit: int, queue_wait_s: float):
        self.limit, self.queue_wait_s = limit, queue_wait_s
        self.in_use = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def take(self, n: int = 1) -> None:
        """Take ``n`` slots now or raise 429 (also while others wait: none jumps the queue); the caller must
        ``give_back(n)`` exactly once after a take."""
        self._check_fits(n)
        if self._waiting or self.in_use + n > self.limit:
            raise self._at_capacity()
        self.in_use += n

    async def acquire(self, n: int = 1) -> None:
        """Take ``n`` slots, waiting up to ``queue_wait_s`` behind the requests already waiting; else 429. A
        cancelled wait (the client gone) leaves the queue."""
        self._check_fits(n)
        if not self._waiting and self.in_use + n <= self.limit:
            self.in_use += n
            return
        if self.queue_wait_s <= 0:
            raise self._at_capacity()
        entry = (n, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            async with asyncio.timeout(self.queue_wait_s):
                await entry[1]
        except (TimeoutError, asyncio.CancelledError) as e:
            if entry[1].done() and not entry[1].cancelled():
                self.give_back(n)  # (granted as the wait ended: given back, the next in line served)
            else:
                entry[1].cancel()
                if entry in self._waiting:  # (a wake after the cancel pops it, skipped)
                    self._waiting.remove(entry)
                self._wake()  # (a large request leaving may let smaller ones behind it in)
            if isinstance(e, TimeoutError):
                raise self._at_capacity(waited=True) from None
            raise

    def give_back(self, n: int = 1) -> None:
        self.in_use -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self.in_use + self._waiting[0][0] <= self.limit:
            n, future = self._waiting.popleft()
            if not future.done():
                self.in_use += n
                future.set_result(None)

    def _check_fits(self, n: int) -> None:
        if n > self.limit:  # (never: a client's 400, not a 429 to retry forever)
            raise GatewayError(400, f"the request needs {n} generations at once (n choices of each prompt), more than "
                                    f"this server runs ({self.limit}, --max-concurrent-requests)", param="n")

    def _at_capacity(self, waited: bool = False) -> GatewayError:
        queued = f"; waited {self.queue_wait_s:g} s in the queue" if waited else ""
        return GatewayError(429, f"the server is at capacity ({self.limit} generations in flight: a request's n "
                                 f"choices are n of them{queued}), retry later")


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
