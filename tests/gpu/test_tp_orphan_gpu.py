"""A tensor-parallel rank whose rank 0 is killed outright ends (tandem.parent_death.exit_with_parent_process): under
NCCL a rank waiting in a broadcast for a dead rank 0 would otherwise hold its GPU's memory forever (gloo, on the CPU,
raises on the closed socket by itself). Skipped without two GPUs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from services import process_running

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

ROOT = Path(__file__).resolve().parents[2]
RANK0 = """
import sys, time
sys.path[:0] = [{root!r}, {tests!r}]
from checkpoints import write_checkpoint
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine

if __name__ == "__main__":
    write_checkpoint({model!r}, "llama", 0)
    engine = LLMEngine(EngineConfig(model={model!r}, tp_size=2, device="cuda", dtype="bfloat16"))
    print(" ".join(str(p.pid) for p in engine.executor._workers), flush=True)
    time.sleep(120)  # (rank 1 waits in a broadcast meanwhile)
"""




def test_rank_1_ends_when_rank_0_is_killed_outright(tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(RANK0.format(root=str(ROOT), tests=str(ROOT / "tests"), model=str(tmp_path / "llama")))
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
    workers = []
    try:
        workers = [int(pid) for pid in rank0.stdout.readline().split()]
        assert workers and all(process_running(pid) for pid in workers)
        rank0.send_signal(signal.SIGKILL)
        rank0.wait(10)
        deadline = time.monotonic() + 20
        while any(process_running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(process_running(pid) for pid in workers)
    finally:
        rank0.kill()
        for pid in workers:
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)
