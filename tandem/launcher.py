"""``tandem up``: start drafter, verifier and gateway on this machine, wait until each is healthy,
print where to send requests, and stop all three (cleanly) on Ctrl-C or when one of them dies.

Each service is its own process, exactly as in production (``python -m drafter|verifier|gateway``);
this only wires their addresses together and supervises them. Torch is never imported here.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from tandem.errors import TandemError


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target model folder (default: the embedded demo target)")
    p.add_argument("--draft-model", default=None, help="EAGLE-3 draft folder (default: the demo draft; 'none' = no speculation)")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--speculative-num-steps", type=int, default=3)
    p.add_argument("--speculative-eagle-topk", type=int, default=1)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=4)
    p.add_argument("--host", default="127.0.0.1", help="where the gateway listens")
    p.add_argument("--port", type=int, default=8000, help="the gateway's REST port (OpenAI API)")
    p.add_argument("--grpc-port", type=int, default=50050, help="the gateway's public gRPC port")
    p.add_argument("--verifier-port", type=int, default=50051)
    p.add_argument("--drafter-port", type=int, default=50052)
    p.add_argument("--metrics-port", type=int, default=50053, help="the verifier's Prometheus port")
    p.add_argument("--otlp-endpoint", default=None, help="send traces of all three services to this OTLP endpoint")
    p.add_argument("--speculation-policy", choices=["measured", "always"], default="measured")
    p.add_argument("--capture-traffic", default=None, metavar="DIR",
                   help="the verifier appends finished requests' tokens and features to DIR (drafter retraining)")


def run_up(args: argparse.Namespace) -> int:
    from tandem.demo import ensure_demo_draft, ensure_demo_target

    model = args.model or str(ensure_demo_target())
    draft = args.draft_model
    if draft is None and args.model is None:
        draft = str(ensure_demo_draft())
    if draft == "none":
        draft = None
    py = [sys.executable, "-m"]
    tracing = ["--otlp-endpoint", args.otlp_endpoint] if args.otlp_endpoint else []
    spec = ["--speculative-num-steps", str(args.speculative_num_steps), "--speculative-eagle-topk",
            str(args.speculative_eagle_topk), "--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens)]
    children = []
    if draft is not None:
        children.append(Child("drafter", py + ["drafter", "--model", draft, "--target-model", model, "--device",
                                              args.device, "--port", str(args.drafter_port), *spec, *tracing]))
    verifier_argv = py + ["verifier", "--model", model, "--tp-size", str(args.tp_size), "--device", args.device,
                          "--port", str(args.verifier_port), "--metrics-port", str(args.metrics_port), *tracing]
    if draft is not None:
        verifier_argv += ["--drafter", f"127.0.0.1:{args.drafter_port}", "--draft-model", draft, *spec,
                          "--speculation-policy", args.speculation_policy]
    if args.capture_traffic:
        verifier_argv += ["--capture-traffic", args.capture_traffic]
    children.append(Child("verifier", verifier_argv))
    name = "tandem-demo" if args.model is None else os.path.basename(os.path.normpath(model))
    children.append(Child("gateway", py + ["gateway", "--verifier", f"127.0.0.1:{args.verifier_port}", "--model-dir",
                                           model, "--host", args.host, "--port", str(args.port), "--grpc-port",
                                           str(args.grpc_port), "--served-model-name", name, *tracing]))
    env = dict(os.environ)
    if args.model is None and args.device == "cpu":
        # The demo's models are tiny: one intra-op thread per service beats torch's default of one per core
        # in each of the drafter and the verifier, which oversubscribes the cores between the two processes.
        # Measured on a 2-core VM, demo pair, chain of 5: 237 -> 272-315 tok/s.
        env.setdefault("OMP_NUM_THREADS", "1")
    try:
        for child in children:
            print(f"starting {child.name} ...", file=sys.stderr, flush=True)
            child.proc = subprocess.Popen(child.argv, env=env)
            _wait_healthy(child, args)
        base = f"http://{args.host}:{args.port}"
        print(f"\nTandem is up ({'EAGLE-3 speculation on' if draft else 'no speculation'}).\n"
              f"  OpenAI API:   {base}/v1   (model: {name})\n"
              f"  gRPC:         {args.host}:{args.grpc_port}   (tandem.rpc.generation.v1.Generation)\n"
              f"  metrics:      {base}/metrics   and   http://127.0.0.1:{args.metrics_port}/metrics (verifier)\n"
              f"  try:  curl {base}/v1/completions -H 'Content-Type: application/json' "
              "-d '{\"prompt\": \"def fibonacci(n):\", \"max_tokens\": 32, \"temperature\": 0}'\n"
              "Ctrl-C stops all three.", flush=True)
        return _supervise(children)
    except KeyboardInterrupt:
        return 0
    finally:
        _stop_all(children)


def _wait_healthy(child: Child, args: argparse.Namespace, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise TandemError(f"{child.name} exited with code {child.proc.returncode} during start-up (see its log above)")
        if _healthy(child.name, args):
            return
        time.sleep(0.3)
    raise TandemError(f"{child.name} did not become healthy within {timeout_s:.0f} s")


def _healthy(name: str, args: argparse.Namespace) -> bool:
    if name == "gateway":
        try:
            return urllib.request.urlopen(f"http://{args.host}:{args.port}/health", timeout=2).status == 200
        except OSError:
            return False
    from tandem.service_probe import is_serving

    return is_serving(args.drafter_port if name == "drafter" else args.verifier_port)


def _supervise(children: list[Child]) -> int:
    while True:
        for child in children:
            code = child.proc.poll()
            if code is not None:
                print(f"{child.name} exited with code {code}; stopping the others", file=sys.stderr)
                return 1
        time.sleep(0.5)


def _stop_all(children: list[Child]) -> None:
    for child in reversed(children):  # gateway first, so no new requests arrive while the others stop
        if child.proc is not None and child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    for child in reversed(children):
        if child.proc is not None:
            try:
                child.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):  # stuck, or a second Ctrl-C: stop now
                child.proc.kill()
