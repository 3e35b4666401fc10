"""The deployment files close what they publish: compose binds published ports to 127.0.0.1 unless
TANDEM_BIND says otherwise, the drafter listens on loopback in the verifier's namespace, both internal
services get the internal secret, services restart on exit, the model volume is read-only and the
demo cache lives in the image; the image runs as a non-root user."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_published_port_binds_loopback_unless_configured():
    published = []
    for name, svc in compose()["services"].items():
        for port in svc.get("ports", []):
            published.append((name, port))
            assert re.fullmatch(r"\$\{TANDEM_BIND:-127\.0\.0\.1\}:\d+:\d+", port), (name, port)
    assert {name for name, _ in published} >= {"gateway", "jaeger", "verifier"}


def test_the_internal_plane_is_loopback_and_needs_the_secret():
    services = compose()["services"]
    drafter, verifier = services["drafter"], services["verifier"]
    assert "--host 127.0.0.1" in drafter["command"] and "0.0.0.0" not in drafter["command"]
    # the verifier requires it of the gateway: its port is reachable from every container on the network
    for svc in (drafter, verifier, services["gateway"]):
        assert svc["environment"]["TANDEM_INTERNAL_SECRET"].startswith("${TANDEM_INTERNAL_SECRET:?")


def test_services_restart_on_exit_and_models_are_read_only():
    for name in ("verifier", "drafter", "gateway"):
        svc = compose()["services"][name]
        assert svc["restart"] in ("unless-stopped", "always", "on-failure"), name
        writable = [v for v in svc["volumes"] if not v.endswith(":ro")]
        assert writable == ["compile-cache:/var/cache/tandem-compile"], svc["volumes"]  # (a named volume: not ./models)


def test_compiled_kernels_outlive_a_recreated_container_in_a_volume_the_services_user_owns():
    """Triton's and FlashInfer's caches point into the named volume (a recreated container would compile them
    again), which Docker creates from the image's folder of the same path: made there for the services' user."""
    spec = compose()
    assert "compile-cache" in spec["volumes"]
    for name in ("verifier", "drafter", "gateway"):
        env = spec["services"][name]["environment"]
        assert env["TRITON_CACHE_DIR"].startswith("/var/cache/tandem-compile/"), name
        assert env["FLASHINFER_WORKSPACE_BASE"] == "/var/cache/tandem-compile", name
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"mkdir -p /var/cache/tandem-compile && chown tandem /var/cache/tandem-compile", dockerfile)
    assert dockerfile.index("chown tandem /var/cache/tandem-compile") < dockerfile.rindex("USER tandem")


def test_the_image_runs_unprivileged_with_its_demo_cache_off_the_model_volume():
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    env = " ".join(line for line in lines if line.startswith("ENV "))
    cache = re.search(r"TANDEM_CACHE=(\S+)", env).group(1)
    assert not cache.startswith("/models")


def test_the_gateway_takes_the_api_key_and_relays_the_verifiers_metrics():
    gateway = compose()["services"]["gateway"]
    assert gateway["environment"]["TANDEM_API_KEY"] == "${TANDEM_API_KEY:-}"  # empty: the gateway reads it as unset
    assert "--verifier-metrics-url http://verifier:50053/metrics" in gateway["command"]


def test_each_service_is_its_containers_process_and_the_drafter_takes_the_draft_shape():
    """A shell left as PID 1 ignores docker stop's SIGTERM (the service was killed after 10 s, undrained): every
    command execs its service under Docker's init; the drafter gets the SPEC_* shape the verifier gets (its draft
    graphs are captured for it); a head shipped as pytorch_model.bin converts into a folder the services' user owns."""
    spec = compose()
    shapes = {}
    for name in ("verifier", "drafter", "gateway"):
        svc = spec["services"][name]
        assert svc["init"] is True, name
        assert svc["command"].startswith("sh -c '") and f"exec python3 -m {name} " in svc["command"], name
        shapes[name] = re.findall(r"--speculative-[a-z-]+ \$\{SPEC_[A-Z_]+:-\d+\}", svc["command"])
    assert shapes["drafter"] == shapes["verifier"] and len(shapes["drafter"]) == 3
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "chown tandem /opt/tandem/cache/converted" in dockerfile
    assert dockerfile.index("chown tandem /opt/tandem/cache/converted") < dockerfile.rindex("USER tandem")


def test_a_drafter_left_in_a_restarted_verifiers_old_namespaces_exits_to_be_restarted_beside_it():
    """A verifier container that restarts gets new namespaces; the drafter sharing the old ones would wait there
    unreachable (speculation off for good): it exits after a grace and restarts beside the verifier as it now is."""
    from drafter.__main__ import build_parser

    svc = compose()["services"]["drafter"]
    grace = re.search(r"--exit-without-verifier-s (\S+?)'?$", svc["command"].strip())
    assert grace, svc["command"]
    assert build_parser().parse_args(["--exit-without-verifier-s", grace.group(1)]).exit_without_verifier_s > 0
    assert svc["restart"] == "unless-stopped" and svc["network_mode"] == "service:verifier"


def _interpolate(text: str, env: dict) -> str:
    """Compose's interpolation of what the commands use: ``${NAME:-default}`` (empty or unset: the default) and
    ``$$`` (a literal ``$`` for the shell)."""
    text = text.replace("$$", "\0")
    text = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), text)
    return text.replace("\0", "$")


def _run_command(service: str, env: dict, tmp_path) -> list[str]:
    """The service's command run by a real shell, with ``python3``, ``sleep`` and ``touch`` stubs that record their
    arguments (``python3 -c`` answers a demo folder) → the recorded lines."""
    log, bin_dir = tmp_path / "calls", tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("python3", "sleep", "touch"):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then echo /demo/folder; exit 0; fi\necho "{tool} $*" >> {log}\n')
        stub.chmod(0o755)
    command = _interpolate(compose()["services"][service]["command"], env)
    subprocess.run(["sh", "-c", command], env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, check=True, capture_output=True)
    return log.read_text().splitlines()


def test_a_model_without_a_draft_is_served_without_speculation_instead_of_failing_on_the_demo_head(tmp_path):
    """MODEL alone used to start the verifier with the demo head (trained for the demo target only): refused at
    start-up, restarted, refused again. Now the verifier serves MODEL with no draft, the drafter idles healthy, and
    the demo pair and a named pair keep their speculation."""
    alone = {"MODEL": "/models/mine"}
    verifier = _run_command("verifier", alone, tmp_path / "alone-verifier")
    assert verifier == ["python3 -m verifier --host 0.0.0.0 --port 50051 --metrics-port 50053 --device cuda "
                        "--tp-size 1 --model /models/mine"]
    drafter = _run_command("drafter", alone, tmp_path / "alone-drafter")
    assert drafter[-2:] == ["touch /tmp/tandem-no-draft", "sleep infinity"] and not any("-m drafter" in c for c in drafter)
    assert compose()["services"]["drafter"]["healthcheck"]["test"][1].startswith("test -e /tmp/tandem-no-draft || ")
    for i, (env, draft) in enumerate((({}, "/demo/folder"),
                                      ({"MODEL": "/models/mine", "DRAFT_MODEL": "/models/head"}, "/models/head"))):
        (verifier,) = _run_command("verifier", env, tmp_path / f"pair{i}-verifier")
        assert f"--draft-model {draft} --drafter localhost:50052 --speculative-num-steps 3" in verifier
        (drafter,) = _run_command("drafter", env, tmp_path / f"pair{i}-drafter")
        assert drafter.startswith("python3 -m drafter ") and f"--model {draft} " in drafter


def test_gateway_args_reach_the_gateway_and_parse(tmp_path):
    """GATEWAY_ARGS appends gateway flags (a tool-call parser, say) to compose's gateway command."""
    from gateway.config import build_parser

    extra = "--tool-call-parser kimi_k2 --reasoning-parser kimi_k2"
    (command,) = _run_command("gateway", {"GATEWAY_ARGS": extra}, tmp_path / "with")
    assert command.endswith(extra)
    args = build_parser().parse_args(command.split()[3:])  # (after "python3 -m gateway")
    assert (args.tool_call_parser, args.reasoning_parser) == ("kimi_k2", "kimi_k2")
    (command,) = _run_command("gateway", {}, tmp_path / "without")
    assert "--tool-call-parser" not in command and command.endswith("--model-dir /demo/folder")
