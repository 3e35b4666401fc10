"""The CPU hidden-state ring: reads from another process, row allocation, and that /dev/shm is left
clean after every way the owner can end (close, exit, exception, SIGTERM, SIGKILL) while a drafter
that crashes leaves the ring usable.

The drafter-like readers and the owners that must exit through the interpreter are fresh
interpreters (``python -c``). Importing torch costs each ~2 s, so the ``children`` fixture starts
them all at once and each waits on stdin until its test hands it work. Owners that die by a signal,
and the attacher that is SIGKILLed, are plain forks: the death is external, so nothing is lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tandem.ring import HiddenRing, HiddenRingView, RingAttachError, RingFullError, RingSpec, posix

ROOT = Path(__file__).resolve().parents[1]

# A stand-in drafter. "attach <JSON list of specs>" attaches to each (dropping earlier views) and says
# "attached"; "read i offset rows path" saves a copy of those rows of ring i to path and says "done".
ATTACHER = r"""
import json, sys, torch
from tandem.ring import HiddenRingView, RingSpec
for line in sys.stdin:
    command, _, rest = line.partition(" ")
    if command == "attach":
        specs = [{**s, "cuda_ipc_handle": bytes.fromhex(s["cuda_ipc_handle"])} for s in json.loads(rest)]
        views = [HiddenRingView.attach(RingSpec.from_fields(s)) for s in specs]
        print("attached", flush=True)
    else:
        i, offset, rows, path = rest.split()
        torch.save(views[int(i)].read(int(offset), int(rows)), path)
        print("done", flush=True)
"""

# Creates a ring, prints its name, waits for a line on stdin, then ends as argv[1] says: "exit" falls
# off the end without close(), "raise" dies of an unhandled exception. Both run without a watchdog,
# to prove that the in-process cleanup works on its own.
OWNER = r"""
import sys, torch
import tandem.ring as ring
ring._START_WATCHDOG = False
r = ring.HiddenRing.create(16, 8, "float32")
r.begin_round(0)
r.write(r.allocate(4), torch.ones(4, 8))
print(r.spec.name, flush=True)
sys.stdin.readline()
if sys.argv[1] == "raise":
    raise RuntimeError("owner crashed")
"""


def _python(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def children() -> Iterator[dict[str, subprocess.Popen]]:
    procs = {f"owner-{m}": _python(OWNER, m) for m in ("exit", "raise")}
    procs["drafter"] = _python(ATTACHER)
    yield procs
    for p in procs.values():  # EOF on stdin ends each child its normal way (owners unlink as they exit)
        p.stdin.close()
    for p in procs.values():
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _send(proc: subprocess.Popen, line: str) -> str:
    """Write a line to the child and return its next line of output (its stderr if it died)."""
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    reply = proc.stdout.readline().strip()
    assert reply, f"child died: {proc.stderr.read()}"
    return reply


def _attach_command(*specs: RingSpec) -> str:
    return "attach " + json.dumps([{**s.to_fields(), "cuda_ipc_handle": s.cuda_ipc_handle.hex()} for s in specs])


def _gone_within(path: str, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _fork(body: Callable[[int], None]) -> tuple[int, int]:
    """Run ``body(write_fd)`` in a forked child that never returns into pytest; returns (pid, read_fd).
    Forking is instant, unlike a fresh interpreter importing torch; the signal tests need no more."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12 warns when a process with threads (torch's, CUDA's) forks. The child only maps
        # shared memory, starts a subprocess and sleeps; it takes no lock another thread could hold.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            body(w)
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def _rand(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- reading from another process ------------------------------------------------------------------

def test_another_process_reads_the_same_values(children, tmp_path):
    rings = [HiddenRing.create(32, 24, dt) for dt in (torch.float32, torch.bfloat16)]
    try:
        reader = children["drafter"]
        for i, ring in enumerate(rings):
            ring.begin_round(7)
            ring.write(ring.allocate(5), _rand(5, 24, ring.tensor.dtype, i))
        assert _send(reader, _attach_command(*(r.spec for r in rings))) == "attached"
        for i, ring in enumerate(rings):
            # written before the attach
            assert _send(reader, f"read {i} 0 5 {tmp_path}/a{i}.pt") == "done"
            got = torch.load(tmp_path / f"a{i}.pt")
            assert got.dtype == ring.tensor.dtype and torch.equal(got, ring.tensor[:5])
            # written after the attach: the reader maps the same memory, not a snapshot
            offset = ring.allocate(3)
            ring.write(offset, _rand(3, 24, ring.tensor.dtype, 10 + i))
            ring.publish()
            assert _send(reader, f"read {i} {offset} 3 {tmp_path}/b{i}.pt") == "done"
            assert torch.equal(torch.load(tmp_path / f"b{i}.pt"), ring.tensor[offset:offset + 3])
    finally:
        for ring in rings:
            ring.close()


def test_spec_round_trips_through_plain_fields():
    with HiddenRing.create(4, 6, "float16") as ring:
        fields = ring.spec.to_fields()
        assert all(isinstance(v, (str, int, bytes)) for v in fields.values())
        assert RingSpec.from_fields(fields) == ring.spec
        assert ring.spec.kind == "posix" and ring.spec.name.startswith(f"tandem-{os.getpid()}-")
        assert ring.tensor.shape == (4, 6) and ring.tensor.dtype == torch.float16


def test_attaching_a_missing_ring_names_it():
    ring = HiddenRing.create(4, 4, "float32")
    ring.close()
    with pytest.raises(RingAttachError, match=f"{ring.spec.name}.*not found"):
        HiddenRingView.attach(ring.spec)


def test_a_view_in_the_same_process_shares_memory_and_checks_bounds():
    with HiddenRing.create(8, 4, "float32") as ring, HiddenRingView.attach(ring.spec) as view:
        ring.write(2, torch.full((2, 4), 3.0))
        alias = view.read(2, 2, copy=False)
        copy = view.read(2, 2)
        ring.write(2, torch.full((2, 4), 5.0))
        assert alias.eq(5).all() and copy.eq(3).all()
        with pytest.raises(IndexError):
            view.read(7, 2)
        with pytest.raises(ValueError):
            ring.write(0, torch.zeros(2, 5))


# --- allocation -------------------------------------------------------------------------------------

@pytest.fixture
def ring() -> Iterator[HiddenRing]:
    with HiddenRing.create(10, 2, "float32") as r:
        yield r


def test_allocations_are_contiguous_and_tagged_by_round(ring):
    ring.begin_round(1)
    assert [ring.allocate(3), ring.allocate(2)] == [0, 3]
    ring.begin_round(2)
    assert ring.allocate(4) == 5
    assert ring.live() == [(0, 3, 1), (3, 2, 1), (5, 4, 2)]
    assert ring.used_rows == 9
    assert ring.release(1) == 5 and ring.live() == [(5, 4, 2)]
    assert ring.release(1) == 0  # a repeated reply frees nothing


def test_allocation_wraps_to_row_zero_when_the_tail_has_no_room(ring):
    ring.begin_round(1)
    ring.allocate(4)
    ring.begin_round(2)
    assert ring.allocate(4) == 4
    ring.release(1)
    ring.begin_round(3)
    assert ring.allocate(3) == 0  # rows 8..9 are free but too few: wrap
    assert ring.allocate(1) == 3
    assert ring.allocate(2) == 8  # next-fit continues after the last allocation


def test_full_ring_raises_until_a_round_is_released(ring):
    ring.begin_round(1)
    ring.allocate(6)
    ring.begin_round(2)
    ring.allocate(3)
    with pytest.raises(RingFullError, match="need 2 contiguous rows, 9 of 10"):
        ring.allocate(2)
    with pytest.raises(RingFullError, match="make the ring larger"):
        ring.allocate(11)
    ring.release(2)
    assert ring.allocate(2) == 6


def test_out_of_order_release_frees_exactly_that_rounds_rows(ring):
    for seq in (1, 2, 3):
        ring.begin_round(seq)
        ring.allocate(3)
    assert ring.release(2) == 3  # the middle round answers first
    assert ring.live() == [(0, 3, 1), (6, 3, 3)]
    ring.begin_round(4)
    with pytest.raises(RingFullError):
        ring.allocate(4)  # only rows 3..5 (3 rows) and 9 (1 row) are free
    assert ring.allocate(3) == 3  # the freed rows of round 2, found past the tail
    assert ring.allocate(1) == 9
    assert ring.release_all() == 10 and ring.used_rows == 0


def test_allocate_needs_a_round():
    with HiddenRing.create(4, 1, "float32") as r, pytest.raises(Exception, match="begin_round"):
        r.allocate(1)


# --- cleanup ----------------------------------------------------------------------------------------

def test_close_unlinks_at_once_and_is_idempotent():
    ring = HiddenRing.create(4, 4, "bfloat16")
    path = posix.shm_path(ring.spec.name)
    assert os.path.exists(path)
    ring.close()
    assert not os.path.exists(path)
    ring.close()


def test_garbage_collected_ring_unlinks():
    ring = HiddenRing.create(4, 4, "float32")
    path = posix.shm_path(ring.spec.name)
    del ring
    assert not os.path.exists(path)


def test_forked_child_does_not_unlink_the_parents_ring():
    with HiddenRing.create(4, 4, "float32") as ring:
        path = posix.shm_path(ring.spec.name)
        pid, r = _fork(lambda w: ring.close())  # the child inherits the object but is not the owner
        os.waitpid(pid, 0)
        os.close(r)
        assert os.path.exists(path)
        ring.tensor[0] = 1.0  # still mapped and writable
    assert not os.path.exists(path)


def _forked_owner(fork_again: bool = False) -> tuple[int, str, int]:
    """A forked process that creates a ring and sleeps; returns (pid, ring path, grandchild pid or -1)."""
    def body(w: int) -> None:
        ring = HiddenRing.create(16, 8, "float32")
        grandchild = os.fork() if fork_again else -1
        if grandchild == 0:
            time.sleep(60)
            os._exit(0)
        os.write(w, f"{ring.spec.name} {grandchild}\n".encode())
        time.sleep(60)

    pid, r = _fork(body)
    with os.fdopen(r) as f:
        name, grandchild = f.readline().split()
    path = posix.shm_path(name)
    assert os.path.exists(path)
    return pid, path, int(grandchild)


@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_owner_ending_without_close_unlinks_in_process(children, mode):
    proc = children[f"owner-{mode}"]
    path = posix.shm_path(proc.stdout.readline().strip())
    assert os.path.exists(path)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.wait(timeout=30) == (1 if mode == "raise" else 0)
    if mode == "raise":
        assert "owner crashed" in proc.stderr.read()
    assert not os.path.exists(path)  # the child ran without a watchdog: its own finalizer did this


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_owner_killed_by_signal_is_cleaned_by_the_watchdog(sig):
    pid, path, _ = _forked_owner()
    os.kill(pid, sig)
    assert os.waitpid(pid, 0)[1] == sig  # killed by the signal, no Python hook ran
    assert _gone_within(path)


def test_watchdog_fires_even_if_the_owner_forked_a_child_that_lives_on():
    pid, path, grandchild = _forked_owner(fork_again=True)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert _gone_within(path)
    finally:
        os.kill(grandchild, signal.SIGKILL)


def test_killed_attacher_leaves_the_ring_and_a_new_one_reads_it(children, tmp_path):
    with HiddenRing.create(16, 8, "bfloat16") as ring:
        path = posix.shm_path(ring.spec.name)
        ring.begin_round(1)
        ring.write(ring.allocate(4), _rand(4, 8, torch.bfloat16, 1))
        spec = RingSpec.from_fields(ring.spec.to_fields())

        def doomed(w: int) -> None:
            view = HiddenRingView.attach(spec)
            os.write(w, f"{view.read(0, 1).sum().item()}\n".encode())
            time.sleep(60)

        pid, r = _fork(doomed)
        with os.fdopen(r) as f:
            assert float(f.readline()) == ring.tensor[0].sum().item()
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        time.sleep(0.1)
        assert os.path.exists(path)
        # the owner carries on: the round the dead drafter never answered is dropped, writing works
        assert ring.release_all() == 4
        ring.begin_round(2)
        offset = ring.allocate(6)
        ring.write(offset, _rand(6, 8, torch.bfloat16, 2))
        successor = children["drafter"]  # another process, which never mapped this ring
        assert _send(successor, _attach_command(ring.spec)) == "attached"
        assert _send(successor, f"read 0 {offset} 6 {tmp_path}/rows.pt") == "done"
        assert torch.equal(torch.load(tmp_path / "rows.pt"), ring.tensor[offset:offset + 6])
    assert not os.path.exists(path)
