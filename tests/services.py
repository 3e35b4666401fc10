"""Start the real services as subprocesses on free loopback ports, for tests over real sockets."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc

from tandem.rpc.verifier.v1 import verifier_pb2 as pb
from tandem.rpc.verifier.v1 import verifier_pb2_grpc as pb_grpc
from tandem.service_probe import free_port, is_serving

ROOT = Path(__file__).resolve().parent.parent


def process_running(pid: int) -> bool:
    """Whether ``pid`` runs, read from /proc (a zombie nobody reaped has ended): the tests' own look, not the code's."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


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
        try:
            self.wait_serving(timeout_s)
        except BaseException:
            self.stop()  # (one that never served is not left running after the failed test)
            raise
        return self

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited ({self.proc.returncode}):\n{self.log()}")
            if is_serving(self.health_port, timeout_s=1.0):
                return
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
    """Sample -> value, keyed without the model_name label every verifier sample carries."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([0-9.eE+-]+|NaN|\+Inf)$", line)
        if m:
            key = re.sub(r',?model_name="[^"]*"', "", m.group(1)).replace("{,", "{").replace("{}", "")
            values[key] = float(m.group(2))
    return values


def shm_segments(prefix: str = "tandem-") -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(prefix + "*")}


def prompts_of(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 + 3 for j in range(2 + (i * 5) % 23)] for i in range(n)]


def start_pair(pair_dirs, tmp_path, drafter_port=None, verifier_args=(), drafter_args=()):
    drafter_metrics = free_port()
    drafter = Service("drafter", ["--model", str(pair_dirs / "draft"), "--target-model", str(pair_dirs / "target"),
                                  "--metrics-port", str(drafter_metrics), *drafter_args],
                      drafter_port or free_port(), tmp_path / "drafter.log").start()
    drafter.metrics_port = drafter_metrics
    metrics_port = free_port()
    verifier = Service("verifier", ["--model", str(pair_dirs / "target"), "--drafter", drafter.address,
                                    "--draft-model", str(pair_dirs / "draft"), "--metrics-port", str(metrics_port),
                                    "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                                    "--speculative-num-draft-tokens", "5",
                                    # these tests check speculation's mechanics; the policy has its own tests
                                    "--speculation-policy", "always", *verifier_args],
                       free_port(), tmp_path / "verifier.log")
    try:
        verifier.start()
        verifier.metrics_port = metrics_port
        wait_for(lambda: read_metrics(metrics_port).get("tandem:drafter_up") == 1.0, 30,
                 "the verifier to reach the drafter")
    except BaseException:  # (the drafter is not left running after the failed test)
        verifier.stop()
        drafter.stop()
        raise
    return drafter, verifier


def gateway_service(verifier_address: str, model_dir, served_model_name: str, log_path: Path) -> Service:
    """The gateway (not started yet) in front of ``verifier_address`` on free ports; its gRPC health answers
    on ``grpc_port``, its OpenAI base URL is ``url``."""
    http_port, grpc_port = free_port(), free_port()
    gateway = Service("gateway", ["--verifier", verifier_address, "--model-dir", str(model_dir),
                                  "--grpc-port", str(grpc_port), "--served-model-name", served_model_name],
                      http_port, log_path, health_port=grpc_port)
    gateway.grpc_port = grpc_port
    gateway.url = f"http://127.0.0.1:{http_port}/v1"
    return gateway


def wait_for(condition, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise TimeoutError(f"waited {timeout_s} s for {what}")


def generate(address, prompt, max_new_tokens=24, progress=None, **sampling):
    """Stream one request; ``progress``: a list whose last item is set to the tokens received so far."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        tokens, last = [], None
        request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
            max_new_tokens=max_new_tokens, ignore_eos=True, **sampling))
        for message in stub.Generate(request, timeout=120):
            tokens += message.token_ids
            last = message
            if progress is not None:
                progress[-1] = len(tokens)
        return tokens, last
