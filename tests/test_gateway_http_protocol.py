"""The gateway's HTTP protocol closes a connection whose request head does not arrive in time (gateway/http_protocol.py):
idle connections and trickled headers were held forever and could take every file descriptor; a request served,
a slow answer and a second request on a kept-alive connection are unaffected. One address holds at most
--max-connections-per-address connections."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest
import uvicorn

from gateway.connection_limit import LINGER_MAX, client_key
from gateway.http_protocol import http_protocol

HEAD_S = 0.5


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["path"] == "/endless":  # (an answer the client never reads: its writes pause)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        chunk = b"x" * (1 << 20)
        for _ in range(64):  # (bounded: once the connection is gone uvicorn's sends return at once, a loop would spin)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(2 * HEAD_S + 0.5)  # (longer than the head deadline: it applies to the head alone)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def served():
    yield from _serve(type("Fast", (http_protocol(),), {"head_timeout_s": HEAD_S, "stall_timeout_s": HEAD_S}))


def _serve(protocol, loop_factory=None):
    """A uvicorn server with ``protocol`` on a thread of its own (``loop_factory``: its event loop's, as the gateway
    runs uvloop's; None: asyncio's)."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_app, lifespan="off", log_config=None, http=protocol, timeout_keep_alive=30))

    def run():
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(server.serve(sockets=[sock]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield server, sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def port(served):
    return served[1]


def _closed_within(conn: socket.socket, seconds: float) -> bool:
    conn.settimeout(seconds)
    try:
        return conn.recv(1024) == b""
    except TimeoutError:
        return False


def _get(conn: socket.socket, path: str = "/") -> bytes:
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    conn.settimeout(10)
    data = b""
    while not data.endswith(b"ok"):
        data += conn.recv(1024)
    return data


def test_a_connection_that_sends_nothing_is_closed(port):
    with socket.create_connection(("127.0.0.1", port)) as conn:
        started = time.monotonic()
        assert _closed_within(conn, 5)
        assert time.monotonic() - started < HEAD_S + 2


def test_trickled_headers_are_closed_at_the_deadline(port):
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\n")
        for _ in range(int(2 * HEAD_S / 0.2)):
            time.sleep(0.2)
            try:
                conn.sendall(b"X-A: b\r\n")
            except OSError:
                break
        assert _closed_within(conn, 5)


def test_requests_slow_answers_and_kept_alive_connections_are_served(port):
    with socket.create_connection(("127.0.0.1", port)) as conn:
        assert _get(conn).startswith(b"HTTP/1.1 200")
        assert _get(conn, "/slow").startswith(b"HTTP/1.1 200")
        time.sleep(2 * HEAD_S)  # (kept alive past the head deadline: it runs from the next request's first byte)
        assert _get(conn).startswith(b"HTTP/1.1 200")


def test_a_connection_that_takes_none_of_its_answer_is_cut(served, caplog):
    """Its writes paused (the client's window full): aborted after the stall timeout (a close would wait for the
    unsent bytes as long as the client keeps the socket open), in a warning that says so (the request's own line
    reads as any client gone)."""
    server, port = served
    caplog.set_level(logging.WARNING, logger="gateway.http")
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn.sendall(b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n")
    accepted = time.monotonic() + 5  # (seen while it stalls: a fixed sleep of the stall timeout raced the abort)
    while not server.server_state.connections and time.monotonic() < accepted:
        time.sleep(0.01)
    assert len(server.server_state.connections) == 1
    deadline = time.monotonic() + 10
    while server.server_state.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.server_state.connections
    assert f"cut the connection from 127.0.0.1:{conn.getsockname()[1]}: it took none of its answer for" in caplog.text
    conn.close()


def _loop_factories():
    try:
        import uvloop
    except ImportError:  # (the gateway runs asyncio's loop then)
        return [None]
    return [None, uvloop.new_event_loop]


@pytest.mark.parametrize("loop_factory", _loop_factories(), ids=lambda f: "asyncio" if f is None else "uvloop")
def test_one_address_holds_at_most_its_connections(loop_factory):
    """Past the limit a connection is answered 429 and closed (what it sent dropped, so that the answer arrives, not a
    reset); a connection closed frees its place, and the server's other connections (a request in flight, another
    server's table) are unaffected."""
    limit = 2
    servers = _serve(http_protocol(limit), loop_factory), _serve(http_protocol(limit), loop_factory)
    (server, port), (_, other_port) = (next(s) for s in servers)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(limit)]
    try:
        assert _get(held[0]).startswith(b"HTTP/1.1 200")
        for send_first in (False, True):  # (a client that sent its request at once reads the answer too, not a reset)
            with socket.create_connection(("127.0.0.1", port)) as refused:
                if send_first:
                    refused.sendall(b"POST / HTTP/1.1\r\nHost: x\r\ncontent-length: 100000\r\n\r\n" + b"x" * 100000)
                refused.settimeout(10)
                answer = b""
                while chunk := refused.recv(4096):
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 429") and b"max-connections-per-address" in answer
        assert _get(held[1]).startswith(b"HTTP/1.1 200")  # (the held ones still served)
        with socket.create_connection(("127.0.0.1", other_port)) as elsewhere:  # (each server counts its own)
            assert _get(elsewhere).startswith(b"HTTP/1.1 200")
        held.pop().close()
        deadline = time.monotonic() + 10
        while len(server.server_state.connections) > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        held.append(socket.create_connection(("127.0.0.1", port)))  # (its place taken again)
        assert _get(held[-1]).startswith(b"HTTP/1.1 200")
        assert dict(type(next(iter(server.server_state.connections)))._open) == {"127.0.0.1": limit}
    finally:
        for conn in held:
            conn.close()
        for s in servers:
            next(s, None)


def test_a_client_is_its_ipv4_address_or_its_ipv6_64():
    assert client_key(("10.1.2.3", 5000)) == "10.1.2.3"
    assert client_key(("2001:db8:1:2:aaaa::1", 5000, 0, 0)) == client_key(("2001:db8:1:2:bbbb::9", 1, 0, 0)) \
        == "2001:db8:1:2::/64"
    assert client_key(("2001:db8:1:3::1", 5000, 0, 0)) != client_key(("2001:db8:1:2::1", 5000, 0, 0))
    assert client_key(("::ffff:10.1.2.3", 5000, 0, 0)) == "10.1.2.3"
    assert client_key(("fe80::1%eth0", 5000, 0, 2)) == "fe80::/64"
    assert client_key("/tmp/socket") is None and client_key(None) is None


def test_refused_connections_that_stay_open_linger_only_so_many():
    """A client that keeps its refused connections open holds the limit and LINGER_MAX more, however many it opens."""
    protocol = http_protocol(1)
    gen = _serve(protocol)
    server, port = next(gen)
    conns = [socket.create_connection(("127.0.0.1", port))]
    try:
        conns += [socket.create_connection(("127.0.0.1", port)) for _ in range(LINGER_MAX + 12)]
        deadline = time.monotonic() + 10
        while protocol._lingering["127.0.0.1"] < LINGER_MAX and time.monotonic() < deadline:
            time.sleep(0.02)  # (until the server has taken the first refusals ...)
        time.sleep(0.5)  # (... and the rest)
        assert protocol._open == {"127.0.0.1": 1} and protocol._lingering == {"127.0.0.1": LINGER_MAX}
        assert len(server.server_state.connections) == 1 + LINGER_MAX
    finally:
        for conn in conns:
            conn.close()
        next(gen, None)


def test_a_negative_limit_is_refused_with_the_flag_named():
    from gateway.config import GatewayConfig
    from gateway_harness import tiny_model_dir

    with pytest.raises(ValueError, match="--max-connections-per-address must be 0"):
        GatewayConfig(verifier="127.0.0.1:1", model_dir=str(tiny_model_dir()), max_connections_per_address=-1)
