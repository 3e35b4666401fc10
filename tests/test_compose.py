"""docker-compose.yml is valid against the Compose specification (no Docker engine needed) and keeps
the invariants the services rely on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_file_matches_the_compose_spec_schema():
    exe = shutil.which("check-jsonschema")
    if exe is None:
        pytest.skip("check-jsonschema is not installed (the dev extra installs it)")
    proc = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(ROOT / "docker-compose.yml")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_wiring():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert {"verifier", "drafter", "gateway", "otel-collector", "jaeger"} <= set(services)
    drafter, verifier, gateway = services["drafter"], services["verifier"], services["gateway"]
    # CUDA IPC and the /dev/shm ring need the drafter inside the verifier's IPC and PID namespaces.
    assert verifier["ipc"] == "shareable"
    assert drafter["ipc"] == "service:verifier" and drafter["pid"] == "service:verifier"
    # The round lane is an abstract Unix socket: it needs the verifier's network namespace too.
    assert drafter["network_mode"] == "service:verifier" and "ports" not in drafter
    for svc in (verifier, drafter):
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        assert "healthcheck" in svc and svc["healthcheck"]["start_period"]
    assert gateway["depends_on"]["verifier"]["condition"] == "service_healthy"
    assert gateway["depends_on"]["drafter"]["condition"] == "service_healthy"
    for svc in (verifier, drafter, gateway):
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://otel-collector:")
    assert "python3 -m verifier" in verifier["command"] and "--drafter localhost:50052" in verifier["command"]


def test_compose_builds_a_gpu_image_with_what_triton_and_flashinfer_compile_with():
    """A plain `docker compose up` builds the CUDA image (DEVICE defaults to cuda): a CUDA devel base (nvcc for
    FlashInfer), CUDA torch, the gpu extra (FlashInfer), and gcc + the Python headers (Triton's launchers)."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    args = compose["x-tandem"]["build"]["args"]
    assert "nvidia/cuda:" in args["BASE"] and "-devel-" in args["BASE"]
    assert "/whl/cu" in args["TORCH_INDEX"] and args["EXTRAS"] == "gpu"
    for name in ("verifier", "drafter", "gateway"):
        assert compose["services"][name]["build"]["args"] == args
    dockerfile = (ROOT / "Dockerfile").read_text()
    install = next(line for line in dockerfile.splitlines() if "apt-get install" in line)
    assert {"gcc", "python3-dev", "python3-pip"} <= set(install.split())
    assert '${EXTRAS:+[${EXTRAS}]}' in dockerfile  # pip install ".[gpu]"
    # The demo pair ships in the package: nothing the read-only model volume could hide, nothing trained.
    assert "COPY tandem tandem" in dockerfile and (ROOT / "tandem" / "demo_pair" / "draft" / "config.json").is_file()
    assert all(v.endswith(":ro") for v in compose["x-tandem"]["volumes"] if v.startswith("./"))  # (host folders)
