"""The gateway keeps an idle HTTP/1.1 connection open for --timeout-keep-alive seconds: by default longer than
clients keep theirs in their pools (httpx and the OpenAI client: 5 s), so that a client never reuses a
connection at the moment the server closes it (the request would be reset: seen at concurrency 64)."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

from gateway_harness import Stack, tiny_model_dir

from gateway.config import build_parser, config_from_args

CLIENT_POOL_KEEP_ALIVE_S = 5.0  # httpx's default keepalive_expiry, which the OpenAI client inherits


def _get(sock: socket.socket, host: str) -> bytes:
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    return sock.recv(4096)


def test_the_default_outlasts_a_client_pools_keep_alive():
    args = build_parser().parse_args(["--verifier", "127.0.0.1:1", "--model-dir", str(tiny_model_dir())])
    assert config_from_args(args).keep_alive_s > 2 * CLIENT_POOL_KEEP_ALIVE_S


def test_an_idle_connection_is_kept_for_the_configured_time_then_closed():
    stack = Stack(keep_alive_s=1.5)
    try:
        url = urlparse(stack.url)
        with socket.create_connection((url.hostname, url.port), timeout=5) as sock:
            assert _get(sock, url.netloc).startswith(b"HTTP/1.1 ")
            time.sleep(0.8)  # idle, shorter than the setting: the same connection serves again
            assert _get(sock, url.netloc).startswith(b"HTTP/1.1 ")
            time.sleep(2.5)  # idle past it: the server has closed the connection (already: no waiting for it)
            sock.settimeout(0.2)
            assert sock.recv(4096) == b""
    finally:
        stack.close()
