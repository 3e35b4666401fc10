"""A tensor-parallel rank that ends unasked ends rank 0's process too (TargetExecutor._watch_ranks): otherwise every
collective after it waits forever under NCCL while the service says SERVING. Ranks ended on purpose — the engine's
shutdown, or the interpreter's exit with the engine still up — are not a loss."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.watchdog import ENGINE_FAILED_EXIT_CODE

ROOT = Path(__file__).resolve().parent.parent
RANK0 = """
import sys, time
sys.path[:0] = [{root!r}, {tests!r}]
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling import SamplingParams

if __name__ == "__main__":
    engine = LLMEngine(EngineConfig(model={model!r}, tp_size=2, device="cpu"))
    print(" ".join(str(p.pid) for p in engine.executor._workers), flush=True)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    print("generated", flush=True)
    if {then!r} == "wait":
        time.sleep(60)  # (idle: rank 1 waits in a broadcast)
    elif {then!r} == "group-term":  # a service's drain on SIGTERM, sent to the whole group (systemd's default)
        import signal
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        print("ready", flush=True)
        while not stop:
            time.sleep(0.05)
        time.sleep(0.5)  # (the drain: a dead rank would be reported meanwhile)
        engine.shutdown()
    elif {then!r} == "shutdown":
        engine.shutdown()
"""


def _rank0(tmp_path, llama, then: str) -> subprocess.Popen:
    script = tmp_path / "rank0.py"
    script.write_text(RANK0.format(root=str(ROOT), tests=str(ROOT / "tests"), model=llama.path, then=then))
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_rank_0_exits_when_another_rank_is_killed(tmp_path, llama):
    rank0 = _rank0(tmp_path, llama, "wait")
    try:
        rank1 = int(rank0.stdout.readline())
        assert rank0.stdout.readline().strip() == "generated"
        os.kill(rank1, signal.SIGKILL)
        assert rank0.wait(20) == ENGINE_FAILED_EXIT_CODE
        err = rank0.stderr.read()
        assert "tensor-parallel rank 1 of 2 ended (exit code -9; see its log above)" in err, err[-2000:]
    finally:
        rank0.kill()


@pytest.mark.parametrize("then", ["exit", "shutdown"])
def test_ranks_ended_on_purpose_are_not_a_loss(tmp_path, llama, then):
    rank0 = _rank0(tmp_path, llama, then)
    try:
        out, err = rank0.communicate(timeout=60)
        assert rank0.returncode == 0 and "generated" in out, err[-2000:]
        assert "ended (exit code" not in err
    finally:
        rank0.kill()


def test_a_sigterm_to_the_whole_group_is_rank_0s_to_answer_not_a_lost_rank(tmp_path, llama):
    """systemd (KillMode=control-group) and a terminal's Ctrl-C signal every process of the group: the ranks leave the
    stop to rank 0, which drains and shuts them down; none dies under it, read as a lost rank (exit 3)."""
    rank0 = _rank0(tmp_path, llama, "group-term")
    try:
        assert rank0.stdout.readline().split() and rank0.stdout.readline().strip() == "generated"
        assert rank0.stdout.readline().strip() == "ready"
        os.killpg(rank0.pid, signal.SIGTERM)
        assert rank0.wait(30) == 0, rank0.stderr.read()[-2000:]
        assert "ended (exit code" not in rank0.stderr.read()
    finally:
        rank0.kill()
