"""``tandem up``: start drafter, verifier and gateway on this machine, wait until each is healthy,
print where to send requests, keep them running, and stop all three (cleanly) on Ctrl-C or SIGTERM.

Each service is its own process, exactly as in production (``python -m drafter|verifier|gateway``);
this only wires their addresses together and supervises them. Torch is never imported here.

Supervision (tandem.supervision): once the stack is up, a service that exits is started again after a back-off. A
service that fails during start-up stops everything with its exit code (a bad flag or model does not get better by
retrying).

The internal plane's secret (tandem.internal_secret) is generated here for each stack unless
$TANDEM_INTERNAL_SECRET is set, written to a private file (0600) that all three services read (``--internal-secret-file``: the drafter and the
verifier require it of their callers; ``tandem reload-drafter`` can use it too), and removed at exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from tandem import args as shared
from tandem import speculative_flags
from tandem import internal_secret, stack_secret
from tandem.errors import TandemError
from tandem.service_probe import free_ports
from tandem.service_runtime import host_port
from tandem.supervision import Child, say, stop_all, supervise
from tandem.up_passthrough import passthrough_words

def add_up_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                   help="the target model, as `vllm serve MODEL` takes it (or --model)")
    shared.add(p, shared.MODEL, shared.REVISION, shared.TP_SIZE, shared.DEVICE, shared.CONFIG, shared.LOG_LEVEL)
    speculative_flags.add_speculative(p, draft_help="EAGLE-3 draft folder (default: the demo draft without --model, else none: "
                                         "no speculation; 'none' turns it off for the demo)")
    p.add_argument("--drafter", choices=["service", "in-process"], default="service",
                   help="service: the head in a drafter process of its own (isolation, hot reload); in-process: in "
                        "the verifier (faster, as tandem generate runs it)")
    shared.add(p, *shared.ENGINE_FLAGS)
    p.add_argument("--speculation-policy", choices=["measured", "always"], default="measured",
                   help="measured: speculate where it pays for the batch; always: every step")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name in the API and metrics; more names, as vLLM takes them, are accepted in "
                        "requests too (default: the folder's name, tandem-demo for the demo)")
    p.add_argument("--host", default="127.0.0.1", help="where the gateway listens")
    p.add_argument("--port", type=shared.port, default=8000, help="the gateway's REST port (OpenAI API)")
    p.add_argument("--grpc-port", type=shared.port, default=50050, help="the gateway's public gRPC port")
    p.add_argument("--verifier-port", type=shared.port, default=None, help="the verifier's gRPC port (default: a free one)")
    p.add_argument("--drafter-port", type=shared.port, default=None, help="the drafter's gRPC port (default: a free one)")
    p.add_argument("--metrics-port", type=shared.port, default=None,
                   help="the verifier's Prometheus port (default: a free one; the gateway's /metrics relays it)")
    for service in ("verifier", "drafter", "gateway"):  # every other setting of a service, passed through as given
        p.add_argument(f"--{service}-args", default="", metavar="'FLAGS'",
                       help=f"more flags for python -m {service}, e.g. --{service}-args '--log-level debug' (they come "
                            "last: they win)")
    p.add_argument("--drafter-metrics-port", type=shared.port, default=None,
                   help="the drafter service's Prometheus port (default: a free one; the gateway's /metrics relays it)")
    shared.add(p, *shared.GATEWAY_FLAGS)
    p.add_argument("--log-stats-interval", type=float, default=None, metavar="SECONDS",
                   help="the verifier's stats line while busy (default: the verifier's, 10 s; 0: off)")
    p.add_argument("--otlp-endpoint", default=None, help="send traces of all three services to this OTLP endpoint")
    p.add_argument("--api-key", default=None, help="the gateway requires it as a bearer token (or set $TANDEM_API_KEY)")
    p.add_argument("--capture-traffic", default=None, metavar="DIR",
                   help="the verifier appends finished requests' tokens and features to DIR (drafter retraining)")
    p.add_argument("--reload-root", default=None, metavar="DIR",
                   help="the drafter reloads heads from below DIR only (default: the draft model's parent folder)")


@dataclass
class UpPlan:
    children: list[Child]
    ports: dict[str, int]  # verifier, drafter, metrics: the internal ones, as given or picked
    model: str
    name: str  # the served model name
    draft: str | None


def _distinct_ports(given: dict[str, int | None], drafter_service: bool) -> None:
    """Each listening socket needs a port of its own: refused before anything starts, naming both flags (the same
    port twice had the gateway fail on itself, or the launcher's HTTP health check read the verifier's gRPC)."""
    seen: dict[int, str] = {}
    for flag, port in given.items():
        if port is None or (not drafter_service and flag.startswith("--drafter")):
            continue
        if port in seen:
            raise TandemError(f"{seen[port]} and {flag} are both {port}: each service listens on a port of its own")
        seen[port] = flag


def plan_up(args: argparse.Namespace, secret_file: str) -> UpPlan:
    """The three services' command lines, every user spelling turned into the services' own flags."""
    if args.model_positional is not None:
        if args.model is not None and args.model != args.model_positional:
            raise TandemError(f"two models: {args.model_positional} and --model {args.model}: give one")
        args.model = args.model_positional
    from tandem.training.demo import ensure_demo_draft, ensure_demo_target

    # (a refused algorithm first, whatever the model; without --model the demo pair's draft comes with it)
    speculative = speculative_flags.resolve_speculative(args, args.model, default_draft=args.model is None)
    model = shared.resolve_target(args) or str(ensure_demo_target())
    draft = speculative.draft_model
    if draft is None and args.model is None:
        draft = str(ensure_demo_draft())
    if draft == shared.NO_DRAFT:
        draft = None
    speculative = dataclasses.replace(speculative, draft_model=draft)
    speculative.require_draft()
    in_process = args.drafter == "in-process"
    if in_process and draft is None:
        raise TandemError("--drafter in-process runs a draft model in the verifier: give --draft-model DIR")
    if in_process and args.reload_root:
        raise TandemError("--reload-root: the drafter service reloads heads, which --drafter in-process does not have")
    passed = {service: passthrough_words(service, getattr(args, f"{service}_args"))
              for service in ("drafter", "verifier", "gateway")}
    flags = {"verifier": "--verifier-port", "drafter": "--drafter-port", "metrics": "--metrics-port",
             "drafter_metrics": "--drafter-metrics-port"}
    given = {"--port": args.port, "--grpc-port": args.grpc_port,
             **{flag: getattr(args, flag[2:].replace("-", "_")) for flag in flags.values()}}
    _distinct_ports(given, draft is not None and not in_process)
    # internal ports not given: free ones, so two stacks on a host do not collide (and none the user gave)
    picked = iter(p for p in free_ports(4 + len(given)) if p not in given.values())
    ports = {name: given[flag] if given[flag] is not None else next(picked) for name, flag in flags.items()}
    py = [sys.executable, "-m"]
    tracing = ["--otlp-endpoint", args.otlp_endpoint] if args.otlp_endpoint else []
    secret = ["--internal-secret-file", secret_file]
    device = ["--device", args.device]
    names = args.served_model_name or []
    name = ("tandem-demo" if args.model is None and not names else shared.served_name(model, names[0] if names else None))
    children = []
    if draft is not None and not in_process:
        reload_root = ["--reload-root", args.reload_root] if args.reload_root else []
        drafter_metrics = ["--metrics-port", str(ports["drafter_metrics"])]
        children.append(Child("drafter", py + ["drafter", "--model", draft, "--target-model", model, *device,
                                              "--port", str(ports["drafter"]), *speculative.argv(),
                                              *_passthrough(args, shared.DRAFTER_ENGINE_FLAGS), *tracing, *secret,
                                              *reload_root, *drafter_metrics, *shared.LOG_LEVEL.argv(args),
                                              *passed["drafter"]]))
    verifier_argv = py + ["verifier", "--model", model, "--served-model-name", name, *shared.TP_SIZE.argv(args),
                          *device, "--port", str(ports["verifier"]), "--metrics-port", str(ports["metrics"]),
                          *_passthrough(args, (*_VERIFIER_ENGINE_FLAGS, shared.LOG_LEVEL)), *tracing, *secret]
    if draft is not None:
        drafter = "in-process" if in_process else f"127.0.0.1:{ports['drafter']}"
        verifier_argv += ["--drafter", drafter, "--draft-model", draft, *speculative.argv(),
                          "--speculation-policy", args.speculation_policy]
    if args.capture_traffic:
        verifier_argv += ["--capture-traffic", args.capture_traffic]
    if args.log_stats_interval is not None:
        verifier_argv += ["--log-stats-interval", str(args.log_stats_interval)]
    children.append(Child("verifier", verifier_argv + passed["verifier"]))
    drafter_relay = (["--drafter-metrics-url", f"http://127.0.0.1:{ports['drafter_metrics']}/metrics"]
                     if draft is not None and not in_process else [])
    # (the gateway names a model given without --served-model-name as the verifier does, and then also takes its path
    # as given for a name, as vLLM and SGLang name it)
    gateway_name = ["--served-model-name", name, *names[1:]] if names or args.model is None else []
    children.append(Child("gateway", py + ["gateway", "--verifier", f"127.0.0.1:{ports['verifier']}", "--model-dir",
                                           model, "--host", args.host, "--port", str(args.port), "--grpc-port",
                                           str(args.grpc_port), *gateway_name, *tracing, *secret,
                                           "--verifier-metrics-url", f"http://127.0.0.1:{ports['metrics']}/metrics",
                                           *drafter_relay,
                                           *_passthrough(args, (*shared.GATEWAY_FLAGS, shared.LOG_LEVEL)),
                                           *passed["gateway"]]))
    return UpPlan(children, ports, model, name, draft)


# (--tokenizer is checked here against the model as given; the verifier is handed the resolved folder instead)
_VERIFIER_ENGINE_FLAGS = tuple(flag for flag in shared.ENGINE_FLAGS if flag is not shared.TOKENIZER)


def _passthrough(args: argparse.Namespace, flags: tuple[shared.Flag, ...]) -> list[str]:
    return [word for flag in flags for word in flag.argv(args)]


def run_up(args: argparse.Namespace) -> int:
    secret_value = internal_secret.load() or internal_secret.generate()
    secret_file = stack_secret.write(secret_value)
    secret_dir = os.path.dirname(secret_file)
    children: list[Child] = []
    previous_term = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the stack as Ctrl-C does
    # ... and SIGINT always: a shell that starts us in the background has it ignored, and the services, which
    # handle it, would stop on a group's SIGINT and be restarted by a launcher that stays up
    previous_int = signal.signal(signal.SIGINT, _interrupt)
    # the terminal closed: the same ordered stop — unless started under nohup (SIGHUP ignored: it keeps running)
    previous_hup = signal.getsignal(signal.SIGHUP)
    if previous_hup is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _interrupt)
    try:
        plan = plan_up(args, secret_file)
        children = plan.children
        env = dict(os.environ)
        if args.api_key:  # through the environment, not the gateway's argv that ps shows
            env[shared.API_KEY_ENV] = args.api_key
        _check_gateway(plan.children[-1], env)  # refused now, not after the models' load (hundreds of GB)
        if args.model is None and args.device in ("cpu", "auto"):
            # The demo's models are tiny: one intra-op thread per service beats torch's default of one per core
            # in each of the drafter and the verifier, which oversubscribes the cores between the two processes.
            # (Harmless on a GPU.)
            env.setdefault("OMP_NUM_THREADS", "1")
        for child in children:
            print(f"starting {child.name} ...", file=sys.stderr, flush=True)
            child.start(env)
            _wait_healthy(child, args, plan.ports)
        base = f"http://{host_port(args.host, args.port)}"
        auth = "-H 'Authorization: Bearer <your API key>' " if env.get(shared.API_KEY_ENV) else ""
        drafter = (f"  drafter: 127.0.0.1:{plan.ports['drafter']} (metrics: http://127.0.0.1:"
                   f"{plan.ports['drafter_metrics']}/metrics), internal secret (tandem reload-drafter "
                   f"--internal-secret-file): {secret_file}\n" if any(c.name == "drafter" for c in children) else "")
        mode = "no speculation" if plan.draft is None else \
            f"EAGLE-3 speculation on, head {'in the verifier' if args.drafter == 'in-process' else 'in the drafter'}"
        print(f"\nTandem is up ({mode}).\n"
              f"  OpenAI API:   {base}/v1   (model: {plan.name})\n"
              f"  gRPC:         {host_port(args.host, args.grpc_port)}   (tandem.rpc.generation.v1.Generation)\n"
              f"  metrics:      {base}/metrics   and   http://127.0.0.1:{plan.ports['metrics']}/metrics (verifier)\n"
              f"  try:  curl {base}/v1/completions -H 'Content-Type: application/json' {auth}"
              "-d '{\"prompt\": \"def fibonacci(n):\", \"max_tokens\": 32, \"temperature\": 0}'\n"
              f"{drafter}Ctrl-C stops every service; a service that exits is restarted.", flush=True)
        return supervise(children, env, healthy=lambda child: _healthy(child.name, args, plan.ports))
    except KeyboardInterrupt:
        killed = stop_all(children)
        if killed:  # (an operator's script sees the stop was not clean)
            say(f"stopped; killed: {', '.join(killed)}")
        return 1 if killed else 0
    finally:
        try:
            stop_all(children)
        finally:
            signal.signal(signal.SIGTERM, previous_term)
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGHUP, previous_hup)
            shutil.rmtree(secret_dir, ignore_errors=True)


def _check_gateway(gateway: Child, env: dict) -> None:
    """The gateway's flags and the model folder's tokenizer and chat template, checked by the gateway itself
    (``--check-config``) before anything starts: the gateway starts last, after the models have loaded."""
    check = subprocess.run(gateway.argv + ["--check-config"], env=env, capture_output=True, text=True)
    if check.returncode != 0:
        lines = check.stderr.strip().splitlines() or [f"exit code {check.returncode}"]
        said = lines[-1].removeprefix("python -m gateway: ").removeprefix("error: ")
        said = said.removesuffix(" (see python -m gateway --help)")
        raise TandemError(f"the gateway refuses its settings: {said}")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _wait_healthy(child: Child, args: argparse.Namespace, ports: dict[str, int], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise TandemError(f"{child.name} exited with code {child.proc.returncode} during start-up (see its log above)")
        if _healthy(child.name, args, ports):
            return
        time.sleep(0.3)
    raise TandemError(f"{child.name} did not become healthy within {timeout_s:.0f} s")


def _healthy(name: str, args: argparse.Namespace, ports: dict[str, int]) -> bool:
    if name == "gateway":
        try:
            return urllib.request.urlopen(f"http://{host_port(args.host, args.port)}/health", timeout=2).status == 200
        except (OSError, http.client.HTTPException):  # (not yet listening, or something else answers there)
            return False
    from tandem.service_probe import is_serving

    return is_serving(ports[name])


