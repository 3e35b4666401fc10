"""The CUDA-IPC hidden-state ring: another process maps the same GPU memory (found by GPU UUID), sees
writes made after it attached, survives a drafter crash, and neither torch's ref-counter file nor
the CUDA driver's IPC file is left in /dev/shm when the owner ends. Skipped without a GPU.

Children are fresh interpreters: CUDA cannot be used in a forked child of a process that has
initialised it, and the drafter is a separate program anyway.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tandem.ring import HiddenRing, RingSpec
from tandem.ring.cuda import gpu_uuid, ref_counter_path

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

ROOT = Path(__file__).resolve().parents[2]

# Reads one spec (JSON) from stdin, attaches, prints "attached <local index> <uuid of that device>",
# then per line "offset rows path" waits for the owner's last publish and saves those rows to path,
# or on "poke offset value" writes value into a row (to show the memory is shared both ways).
ATTACHER = r"""
import json, sys, torch
from tandem.ring import HiddenRingView, RingSpec
from tandem.ring.cuda import gpu_uuid
s = json.loads(sys.stdin.readline())
view = HiddenRingView.attach(RingSpec.from_fields({**s, "cuda_ipc_handle": bytes.fromhex(s["cuda_ipc_handle"])}))
dev = view.tensor.device.index
print("attached", dev, gpu_uuid(dev), flush=True)
for line in sys.stdin:
    words = line.split()
    if words[0] == "poke":
        view.tensor[int(words[1])] = float(words[2])
        torch.cuda.synchronize()
    else:
        view.wait_ready()
        torch.save(view.read(int(words[0]), int(words[1])).cpu(), words[2])
    print("done", flush=True)
"""

# Creates a ring on cuda:0, prints the torch ref-counter file it uses and the glob of the CUDA driver's
# IPC file, then exits cleanly on a line from stdin or waits to be killed.
OWNER = r"""
import os, sys
import tandem.ring as ring
from tandem.ring.cuda import driver_ipc_glob, ref_counter_path
r = ring.HiddenRing.create(8, 16, "bfloat16", "cuda:0")
print(ref_counter_path(r.spec.cuda_ipc_handle), driver_ipc_glob(os.getpid()), flush=True)
sys.stdin.readline()
"""


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _send(proc: subprocess.Popen, line: str) -> str:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    reply = proc.stdout.readline().strip()
    assert reply, f"child died: {proc.stderr.read()}"
    return reply


def _spec_json(spec: RingSpec) -> str:
    return json.dumps({**spec.to_fields(), "cuda_ipc_handle": spec.cuda_ipc_handle.hex()})


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_another_process_maps_the_same_gpu_memory(tmp_path):
    ring = HiddenRing.create(64, 3 * 128, torch.bfloat16, "cuda:0")
    reader = _python(ATTACHER)
    try:
        assert ring.spec.kind == "cuda_ipc" and ring.spec.gpu_uuid == gpu_uuid(0)
        ring.begin_round(1)
        first = torch.randn(10, 384, device="cuda:0", dtype=torch.bfloat16)
        ring.write(ring.allocate(10), first)
        ring.publish()
        word, dev, uuid = _send(reader, _spec_json(ring.spec)).split()
        assert word == "attached" and uuid == ring.spec.gpu_uuid
        assert _send(reader, f"0 10 {tmp_path}/a.pt") == "done"
        assert torch.equal(torch.load(tmp_path / "a.pt"), first.cpu())
        # written after the attach and never re-sent: the reader sees it because it maps this memory
        offset = ring.allocate(5)
        later = torch.randn(5, 384, device="cuda:0", dtype=torch.bfloat16)
        ring.write(offset, later)
        ring.publish()
        assert _send(reader, f"{offset} 5 {tmp_path}/b.pt") == "done"
        assert torch.equal(torch.load(tmp_path / "b.pt"), later.cpu())
        # and the other way round
        assert _send(reader, "poke 63 42") == "done"
        assert ring.tensor[63].eq(42).all()
    finally:
        _stop(reader)
        ring.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_attacher_finds_the_gpu_by_uuid_when_indices_differ(tmp_path):
    ring = HiddenRing.create(4, 8, torch.float32, "cuda:1")
    # the reader sees the GPUs in the opposite order, so the owner's index 1 is its index 0
    order = ",".join(str(i) for i in reversed(range(torch.cuda.device_count())))
    reader = _python(ATTACHER, {"CUDA_VISIBLE_DEVICES": order})
    try:
        ring.write(0, torch.arange(32.0, device="cuda:1").view(4, 8))
        ring.publish()
        word, dev, uuid = _send(reader, _spec_json(ring.spec)).split()
        assert uuid == gpu_uuid(1) and int(dev) == torch.cuda.device_count() - 2
        assert _send(reader, f"0 4 {tmp_path}/a.pt") == "done"
        assert torch.equal(torch.load(tmp_path / "a.pt"), torch.arange(32.0).view(4, 8))
    finally:
        _stop(reader)
        ring.close()


def test_a_killed_drafter_leaves_the_ring_for_its_successor(tmp_path):
    ring = HiddenRing.create(16, 64, torch.float16, "cuda:0")
    doomed, successor = _python(ATTACHER), _python(ATTACHER)
    try:
        ring.begin_round(1)
        ring.write(ring.allocate(4), torch.ones(4, 64, device="cuda:0"))
        ring.publish()
        assert _send(doomed, _spec_json(ring.spec)).startswith("attached")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        ring.release_all()
        ring.begin_round(2)
        offset = ring.allocate(8)
        rows = torch.randn(8, 64, device="cuda:0", dtype=torch.float16)
        ring.write(offset, rows)
        ring.publish()
        assert _send(successor, _spec_json(ring.spec)).startswith("attached")
        assert _send(successor, f"{offset} 8 {tmp_path}/a.pt") == "done"
        assert torch.equal(torch.load(tmp_path / "a.pt"), rows.cpu())
    finally:
        _stop(doomed)
        _stop(successor)
        ring.close()


@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_no_ipc_file_is_left_when_the_owner_ends(end):
    owner = _python(OWNER)
    try:
        line = owner.stdout.readline().split()
        assert line, owner.stderr.read()
        path, driver_glob = line
        assert path.startswith("/dev/shm/torch_") and os.path.exists(path)
        assert glob.glob(driver_glob)  # if the driver stops creating it, this test needs a look
        if end == "exit":
            owner.stdin.write("\n")
            owner.stdin.flush()
            assert owner.wait(timeout=60) == 0
        else:
            owner.send_signal(signal.SIGKILL)
            owner.wait(timeout=60)
        deadline = time.monotonic() + 5
        while (os.path.exists(path) or glob.glob(driver_glob)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not os.path.exists(path) and not glob.glob(driver_glob)
    finally:
        _stop(owner)
