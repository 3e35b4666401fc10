"""signal_on_parent_death (tandem/parent_death.py, what a service started by `tandem up` asks for): a process that
asked goes with its parent killed outright; one that did not outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from services import process_running

ROOT = Path(__file__).resolve().parent.parent
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {child!r}])
print(child.pid, flush=True)
time.sleep(60)
"""
CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from tandem.parent_death import signal_on_parent_death
import signal
if {ask}:
    assert signal_on_parent_death(signal.SIGKILL)
print("ready", flush=True)  # (on the parent's stdout, which it shares)
time.sleep(60)
"""




@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("ask", [True, False])
def test_a_child_that_asked_goes_with_its_parent_killed_outright(ask):
    _goes_with_its_parent([sys.executable, "-c", PARENT.format(child=CHILD.format(root=str(ROOT), ask=ask))], ask)


def _goes_with_its_parent(parent_argv: list[str], asked: bool) -> None:
    """Start the parent (it prints its child's pid, the child "ready"), kill it outright: the child goes with it
    within 10 s where it ``asked``, and outlives it by 1.5 s where it did not."""
    parent = subprocess.Popen(parent_argv, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline().strip() == "ready" and process_running(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + (10 if asked else 1.5)
        while process_running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_running(child) is not asked
    finally:
        parent.kill()
        if process_running(child):
            os.kill(child, signal.SIGKILL)


MP_PARENT = """
import multiprocessing as mp, sys, time
sys.path.insert(0, {root!r})

def rank(ask):
    from tandem.parent_death import exit_with_parent_process
    if ask:
        assert exit_with_parent_process("test rank")
    print("ready", flush=True)
    time.sleep(60)  # (a rank blocked in a collective whose rank 0 is gone)

if __name__ == "__main__":
    child = mp.get_context({method!r}).Process(target=rank, args=({ask},), daemon=True)
    child.start()
    print(child.pid, flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])  # (the executor's contexts on GPUs and on the CPU)
@pytest.mark.parametrize("ask", [True, False])
def test_a_multiprocessing_child_that_watches_goes_with_its_parent_killed_outright(tmp_path, method, ask):
    script = tmp_path / "parent.py"
    script.write_text(MP_PARENT.format(root=str(ROOT), method=method, ask=ask))
    _goes_with_its_parent([sys.executable, str(script)], ask)


def test_a_process_not_started_by_multiprocessing_has_no_parent_to_watch():
    from tandem.parent_death import exit_with_parent_process

    assert exit_with_parent_process("the test process") is False
