"""Ports and addresses as an operator gives them: a taken port refused before anything loads (``tandem up`` asked
another stack's gateway for its health and announced it as its own; the gateway died with a traceback on a taken gRPC
port), and IPv6 hosts bracketed where gRPC and URLs need it."""

from __future__ import annotations

import socket
import subprocess
import sys

import grpc
import pytest

from tandem.errors import TandemError
from tandem.service_runtime import check_can_listen, host_port, listen


def test_host_port_brackets_ipv6_only():
    assert host_port("127.0.0.1", 5) == "127.0.0.1:5" and host_port("localhost", 5) == "localhost:5"
    assert host_port("::", 5) == "[::]:5" and host_port("::1", 5) == "[::1]:5" and host_port("[::1]", 5) == "[::1]:5"


def test_a_taken_port_is_refused_in_one_line_a_free_one_taken():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        with pytest.raises(TandemError, match=rf"cannot listen on 127.0.0.1:{taken}: .*another server runs there"):
            check_can_listen("127.0.0.1", (0, taken))
    check_can_listen("127.0.0.1", (taken,))  # (free again)


def test_the_gateways_config_check_refuses_a_taken_port(tmp_path):
    """What tandem up runs before the models load (tandem.launcher._check_gateway)."""
    from gateway_harness import tiny_model_copy

    model = tiny_model_copy(tmp_path / "m")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        for flag in ("--port", "--grpc-port"):
            other = "--grpc-port" if flag == "--port" else "--port"
            done = subprocess.run([sys.executable, "-m", "gateway", "--verifier", "127.0.0.1:1", "--model-dir", str(model),
                                   flag, str(taken), other, "0", "--check-config"], capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == 2, done.stderr
            assert done.stderr.strip().splitlines()[-1].startswith(f"error: cannot listen on 127.0.0.1:{taken}"), \
                done.stderr


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_grpc_listens_on_an_ipv6_host():
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(1))
    try:
        assert listen(server, host_port("::1", 0)) > 0
    finally:
        server.stop(None)


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_a_gateway_started_on_a_taken_port_ends_in_one_line(tmp_path, flag):
    """Checked before either server starts: no "Exception ignored ... Event loop is closed" after the REST port's error,
    no gRPC core log line before the gRPC port's."""
    from gateway_harness import tiny_model_copy

    model = tiny_model_copy(tmp_path / "m")
    other = "--grpc-port" if flag == "--port" else "--port"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "gateway", "--verifier", "127.0.0.1:1", "--model-dir", str(model),
                               flag, str(taken), other, "0"], capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if " INFO " not in line]
    assert done.returncode == 1 and lines == [f"error: cannot listen on 127.0.0.1:{taken}: Address already in use "
                                              "(another server runs there? choose another port)"], done.stderr
