"""Client-side checks of a local service: a free port to start one on, and its gRPC health.

Used by ``tandem up``, the retraining experiment, the benchmark and the tests, which all start the
services as processes and wait until they say SERVING. Torch-free.
"""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
