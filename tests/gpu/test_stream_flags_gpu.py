"""Stream flags in shared host memory (tandem/ring/stream_flags.py): another process's stream waits for
a flag this one's stream writes, sees the data written before the write, and a host can release a
stream that waits on a flag no one else will write (a dead drafter). Skipped without a GPU."""

from __future__ import annotations

import mmap
import secrets
import time

import pytest
import torch

from tandem.ring import HiddenRing, posix
from tandem.ring.stream_flags import StreamFlags
from test_shm_ring_cuda import _python, _spec_json, _stop

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

# Maps the ring (spec on stdin) and the flags page (name on stdin); its stream waits for flag 0, then
# doubles row 0 of the ring into row 1 and writes flag 1. Says "queued" before the owner writes anything.
DOUBLER = r"""
import faulthandler, json, mmap, sys, torch
faulthandler.dump_traceback_later(30, exit=True)  # a hang shows where, on stderr
from tandem.ring import HiddenRingView, RingSpec, posix
from tandem.ring.stream_flags import StreamFlags
s = json.loads(sys.stdin.readline())
view = HiddenRingView.attach(RingSpec.from_fields({**s, "cuda_ipc_handle": bytes.fromhex(s["cuda_ipc_handle"])}))
flags = StreamFlags(posix.open_segment(sys.stdin.readline().strip(), mmap.PAGESIZE), 2, view.tensor.device)
stream = torch.cuda.current_stream()
view.tensor[1].copy_(view.tensor[0] * 2)  # the kernels' first launch (module loading waits for the context)
torch.cuda.synchronize()
flags.wait(stream, 0, 1)
view.tensor[1].copy_(view.tensor[0] * 2)
flags.write(stream, 1, 1)
print("queued", flush=True)
torch.cuda.synchronize()
print("done", flush=True)
faulthandler.cancel_dump_traceback_later()
"""


@pytest.fixture
def flags_page():
    name = f"tandem-test-flags-{secrets.token_hex(6)}"
    page = posix.create_segment(name, mmap.PAGESIZE)
    yield name, page
    posix.unlink(posix.shm_path(name))


def test_another_process_waits_for_the_flag_and_sees_the_data_written_before_it(flags_page):
    name, page = flags_page
    ring = HiddenRing.create(4, 256, torch.float32, "cuda:0")
    flags = StreamFlags(page, 2, torch.device("cuda", 0))
    child = _python(DOUBLER)
    try:
        child.stdin.write(_spec_json(ring.spec) + "\n" + name + "\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "queued", child.stderr.read()
        stream = torch.cuda.current_stream()
        torch.cuda._sleep(200_000_000)  # ~0.1 s: a child not held by the flag would read row 0 still zero
        ring.tensor[0].copy_(torch.arange(256, dtype=torch.float32, device="cuda:0"))
        flags.write(stream, 0, 1)
        flags.wait(stream, 1, 1)  # this stream goes on only after the child's doubling
        doubled = ring.tensor[1].clone()
        finished = torch.cuda.Event()
        finished.record(stream)
        deadline = time.monotonic() + 40  # past the child's own 30 s dump
        while not finished.query():
            if time.monotonic() > deadline:
                flags[1] = 1  # release this stream before failing
                torch.cuda.synchronize()
                _stop(child)
                pytest.fail(f"the child's flag never came (flags {flags[0]}, {flags[1]}): {child.stderr.read()}")
            time.sleep(0.001)
        assert child.stdout.readline().strip() == "done", child.stderr.read()
        assert torch.equal(doubled.cpu(), 2 * torch.arange(256, dtype=torch.float32))
        assert flags[0] == 1 and flags[1] == 1  # both writes reached the shared page
    finally:
        _stop(child)
        flags.close()
        ring.close()


@pytest.mark.parametrize("base", [0, 2**32])
def test_the_host_releases_a_stream_waiting_on_a_flag_no_peer_writes(flags_page, base):
    """From ``base`` 2**32 on: the flag holding the round before (2**32 - 1), a wait for a round past 2**32 must
    hold (32-bit flags wrapped: the wait passed at once)."""
    _, page = flags_page
    flags = StreamFlags(page, 1, torch.device("cuda", 0))
    flags[0] = max(base - 1, 0)
    stream = torch.cuda.Stream()
    torch.ones(4, device="cuda:0") * 3  # the kernels' first launch, before any wait (see the child above)
    torch.cuda.synchronize()
    flags.wait(stream, 0, base + 5)
    with torch.cuda.stream(stream):
        after = torch.ones(4, device="cuda:0") * 3
    done = torch.cuda.Event()
    done.record(stream)
    try:
        time.sleep(0.2)
        assert not done.query()  # held: nothing wrote the flag
        flags[0] = base + 4
        time.sleep(0.05)
        assert not done.query()  # 4 < 5
        flags[0] = base + 5
        deadline = time.monotonic() + 5
        while not done.query():
            assert time.monotonic() < deadline, "the host's write did not release the stream"
            time.sleep(0.001)
        assert torch.equal(after.cpu(), torch.full((4,), 3.0))
    finally:
        flags[0] = base + 5  # never leave a stream waiting at teardown
        torch.cuda.synchronize()
        flags.close()
