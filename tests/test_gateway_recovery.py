"""The gateway serves again within seconds of its verifier coming back: a verifier stopped, down for
a while, restarted on the same port. (Measured on loopback after 20 s down: 0.4 s with the bounded
backoff, 4.6 s with gRPC's default, whose backoff keeps growing to 2 minutes; this test keeps the
outage short, so the channel's options are checked as well.)"""

from __future__ import annotations

import time

import httpx
from fake_verifier import start_fake_verifier
from gateway_harness import MODEL_NAME, Stack, wait_until

from gateway import upstream
from tandem.service_probe import free_port

GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}
DOWN_S = 6.0
BACK_WITHIN_S = 2.0


def _status(stack) -> int:
    return httpx.post(f"{stack.url}/v1/completions", json=GOOD, timeout=10).status_code


def test_the_gateway_serves_again_within_seconds_of_a_verifier_restart():
    port = free_port()
    stack = Stack(verifier=f"127.0.0.1:{port}")
    server = None
    try:
        assert _status(stack) == 503  # nobody there yet
        server, _, _ = stack.run(start_fake_verifier(stack.vocab_size, port=port))
        wait_until(lambda: _status(stack) == 200, 5, "the first verifier")
        stack.run(server.stop(0))
        down_until = time.monotonic() + DOWN_S
        while time.monotonic() < down_until:  # clients keep trying meanwhile: each gets a clean 503
            assert _status(stack) == 503
            time.sleep(0.5)
        server, _, _ = stack.run(start_fake_verifier(stack.vocab_size, port=port))
        back = time.monotonic()
        wait_until(lambda: _status(stack) == 200, BACK_WITHIN_S, f"the gateway to serve within {BACK_WITHIN_S} s")
        elapsed = time.monotonic() - back
        wait_until(lambda: httpx.get(f"{stack.url}/health", timeout=5).status_code == 200, 2, "health")
        assert elapsed < BACK_WITHIN_S
    finally:
        if server is not None:
            stack.run(server.stop(0))
        stack.close()


def test_the_verifier_channel_retries_at_least_every_second():
    options = dict(upstream._CHANNEL_OPTIONS)
    assert options["grpc.max_reconnect_backoff_ms"] <= 1_000
    assert options["grpc.initial_reconnect_backoff_ms"] <= options["grpc.max_reconnect_backoff_ms"]


def test_a_hung_verifier_gets_new_requests_refused_at_once_not_left_waiting():
    """A verifier that stops answering (SIGSTOP, a hang) while its socket still accepts: once two health checks in a
    row go unanswered, new generations are refused with a 503 clients retry, not held with no deadline."""
    stack = Stack()
    try:
        assert _status(stack) == 200
        stack.fake.hung = True
        wait_until(lambda: httpx.get(f"{stack.url}/health", timeout=5).status_code == 503, 5, "health to say 503")
        wait_until(lambda: stack.gateway.client.failed_checks >= 2, 5, "a second check to find it not serving")
        started = time.monotonic()
        r = httpx.post(f"{stack.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert time.monotonic() - started < 1.0
        stack.fake.hung = False
        wait_until(lambda: _status(stack) == 200, 5, "the gateway to serve again")
    finally:
        stack.fake.hung = False
        stack.close()
