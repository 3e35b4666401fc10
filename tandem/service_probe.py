"""Client-side checks of a local service: a free port to start one on, and its gRPC health.

Used by ``tandem up``, the retraining experiment, the benchmark and the tests, which all start the
services as processes and wait until they say SERVING. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import time

PORT_FLOOR = 20000  # free ports are picked from here up to the ephemeral range (clear of well-known services)
# "LOW-HIGH": the ports free_ports picks from instead (HIGH excluded). The tests give each pytest-xdist worker its own
# (tests/conftest.py; the services they start inherit it): a drafter killed and started again at its address found
# its port taken meanwhile by a service of the other worker ("Address already in use").
PORT_RANGE_ENV = "TANDEM_PORT_RANGE"


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now, held together while picked (so none repeats). Picked below the kernel's
    ephemeral range where it leaves room: that range is where outgoing connections take their local ports, and a port
    picked there (what binding port 0 gives) was taken by some client's connection before the service bound it (the
    CI's service tests, two workers starting services side by side: "Address already in use"). PORT_RANGE_ENV narrows
    the range."""
    low, high = port_range()
    pick = random.SystemRandom()
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(100 * n):
            if len(ports) == n:
                break
            s = stack.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", pick.randrange(low, high) if high - low > 1000 else 0))
            except OSError:
                continue
            ports.append(s.getsockname()[1])
        while len(ports) < n:  # (nearly everything below the range taken: the kernel's pick)
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def free_port() -> int:
    return free_ports(1)[0]


def port_range() -> tuple[int, int]:
    """(low, high): the ports free_ports picks from, high excluded: PORT_RANGE_ENV's where set, else PORT_FLOOR up to
    the kernel's ephemeral range."""
    given = os.environ.get(PORT_RANGE_ENV)
    if given:
        low, _, high = given.partition("-")
        return int(low), int(high)
    return PORT_FLOOR, _ephemeral_low()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; elsewhere the IANA range's)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def is_serving(port: int, host: str = "127.0.0.1", timeout_s: float = 2.0) -> bool:
    """Whether gRPC health (the overall service, "") answers SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_serving(port: int, timeout_s: float, proc: subprocess.Popen | None = None, name: str = "service") -> None:
    """Poll until SERVING; RuntimeError when ``proc`` exits first, TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} on port {port} exited with code {proc.returncode}")
        if is_serving(port, timeout_s=1.0):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{name} on port {port} not serving after {timeout_s} s")
