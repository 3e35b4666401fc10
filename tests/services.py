"""Start the real services as subprocesses on free loopback ports, for tests over real sockets."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, module: str, args: list[str], port: int, log_path: Path, env: dict | None = None,
                 health_port: int | None = None):
        """``health_port``: where gRPC health answers, when not ``port`` (the gateway's REST port)."""
        self.module, self.args, self.port, self.log_path = module, args, port, log_path
        self.health_port = health_port or port
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> "Service":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, "--port", str(self.port), *self.args],
                                     cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.wait_serving(timeout_s)
        return self

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.module} exited ({self.proc.returncode}):\n{self.log()}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"{self.module} not SERVING after {timeout_s} s:\n{self.log()}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode if self.proc else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""


def read_metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([0-9.eE+-]+|NaN|\+Inf)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


def shm_segments(prefix: str = "tandem-") -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(prefix + "*")}
