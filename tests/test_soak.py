"""A short soak of the whole stack (scripts/soak.py): mixed REST/gRPC, streaming and not, client
disconnects, the drafter SIGKILLed every few seconds and the verifier restarted once; nothing lost,
nothing wrong, the KV pages back, no shared memory left, every killed service restarted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("procs")]  # a stack of services: with the others (conftest.py)


def test_a_short_soak_loses_nothing(tmp_path):
    out = tmp_path / "soak.json"
    # The soak's size is counted, not timed: it runs 15 s and then on until 50 requests were sent and the
    # drafter was killed twice, so a slow (or busy) machine runs longer rather than failing a throughput floor.
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--seconds", "15",
                           "--min-requests", "50", "--min-drafter-kills", "2",
                           "--kill-drafter-every", "4", "--clients", "2", "--prompts", "6",
                           "--workdir", str(tmp_path / "work"), "--json-out", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    requests = report["requests"]
    assert requests["lost"] == 0 and requests["wrong"] == 0, report["failures"]
    # every request sent is accounted for: served right or abandoned by its client, none in between
    assert requests["submitted"] >= 50
    assert requests["served"] + requests["cancelled"] == requests["submitted"], requests
    assert requests["served"] >= 1 and requests["cancelled"] >= 1
    assert report["faults"]["drafter_sigkill"] >= 2 and report["faults"]["verifier_restart"] == 1, report["faults"]
    # each killed service restarted by the launcher: the soak waits (at most 60 s) for the restarts it owes
    # before counting them (the last kill's back-off may still run when the clients stop)
    restarts = report["launcher_restarts"]
    assert restarts["drafter"] >= 2 and restarts["verifier"] == 1, (restarts, report["restarts_waited_s"])
    assert restarts["drafter"] >= report["faults"]["drafter_sigkill"], (restarts, report["faults"])
    assert report["kv_pages"]["back_to_total"] and report["shm_left"] == []
    assert proc.returncode == 0
