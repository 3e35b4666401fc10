"""The round mailbox: what a run of chain rounds passes between the drafter process and the verifier on
the device, and the two sequence flags that order it.

In process, a run of greedy chain rounds is queued on one stream (tandem.speculative.chain_rounds).
Across the service pair each round crosses twice: the drafter's chain goes to the verifier's verify,
the verifier's accepted tokens, their features and the count go to the drafter's extend. Both hosts
queue a whole run ahead; the data goes through this mailbox, which the verifier owns (it outlives any
drafter) and shares like the hidden-state ring (CUDA IPC on GPU, /dev/shm on CPU), and the order
through two flags in a shared page (tandem.ring.stream_flags): the drafter's stream writes DRAFTED =
g + 1 once round g's chain is in the mailbox, the verifier's writes ACCEPTED = g + 1 once round g's
accept is; each side's stream waits for the other's flag before reading. g counts rounds over the
verifier's lifetime and never goes back, so a write left over from an earlier connection can only
name an older round. The verifier's host can release its own waits (a drafter that died or is late):
it writes DRAFTED itself, and the verify takes whatever chain the mailbox holds as a guess
(tandem.speculative.remote_rounds: the root is the verifier's own, the tokens are sanitised), so
the output is the target's whatever the drafter left there.

On CPU there are no streams: every torch op has finished when it returns, so a "wait" is the host
polling the flag (``HostFlags``), which is what the CPU tests run.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import time
from dataclasses import dataclass

import torch

from tandem.ring import HiddenRing, HiddenRingView, RingSpec, posix
from tandem.ring.stream_flags import FLAG_BYTES, StreamFlags
from tandem.speculative.proposer import ProposerUnavailable

log = logging.getLogger("tandem.round_mailbox")
DRAFTED, ACCEPTED = 0, 1  # the flags' indices
_ALIGN = 256  # bytes: every region starts on a boundary any dtype's kernels load from


class MailboxTimeout(ProposerUnavailable):
    """A host wait for the peer's flag (CPU) passed its deadline: the peer is taken as gone."""


class HostFlags:
    """The flags of a CPU mailbox: the host waits (polls) and writes; the ``stream`` arguments are
    ignored, since on CPU the work before a write has finished when it is issued."""

    def __init__(self, buffer: mmap.mmap, count: int, wait_s: float = 60.0):
        self._view = memoryview(buffer)[: FLAG_BYTES * count].cast("Q")
        self.count, self.wait_s = count, wait_s

    def wait(self, stream, i: int, seq: int) -> None:
        deadline = time.monotonic() + self.wait_s
        while self._view[i] < seq:
            if time.monotonic() > deadline:
                raise MailboxTimeout(f"flag {i} did not reach {seq} within {self.wait_s:.0f} s")
            time.sleep(0.0002)

    def write(self, stream, i: int, seq: int) -> None:
        self._view[i] = seq

    def __getitem__(self, i: int) -> int:
        return self._view[i]

    def __setitem__(self, i: int, seq: int) -> None:
        self._view[i] = seq

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class MailboxLayout:
    max_bs: int  # requests per run
    max_nd: int  # chain length (root included) of the widest spec
    feature_width: int  # 3 · H_target: the ring's row width
    feature_dtype: torch.dtype

    def regions(self) -> dict[str, tuple[int, torch.dtype, tuple[int, ...]]]:
        """name → (byte offset, dtype, shape)."""
        b, nd = self.max_bs, self.max_nd
        shapes = {"rows": (torch.float64, (b, 3 * nd + 1)),  # the draft's rows (static_draft's layout)
                  "ids": (torch.int64, (b, nd)),  # the extend's tokens: accepted drafts, the bonus, zeros
                  "counts": (torch.int64, (b,)),  # tokens the round emitted
                  "features": (self.feature_dtype, (b * nd, self.feature_width))}  # zero past each count
        out, at = {}, 0
        for name, (dtype, shape) in shapes.items():
            out[name] = (at, dtype, shape)
            at += -(-torch.Size(shape).numel() * dtype.itemsize // _ALIGN) * _ALIGN
        return out

    @property
    def nbytes(self) -> int:
        last_at, dtype, shape = list(self.regions().values())[-1]
        return last_at + torch.Size(shape).numel() * dtype.itemsize


class RoundMailbox:
    """The mailbox's tensors (``rows``, ``ids``, ``counts``, ``features``: see MailboxLayout) and flags."""

    def __init__(self, layout: MailboxLayout, storage, flags, flags_name: str):
        self.layout, self.flags, self.flags_name = layout, flags, flags_name
        self._storage = storage  # HiddenRing (the verifier's) or HiddenRingView (the drafter's)
        raw = storage.tensor.view(-1).view(torch.uint8)
        for name, (at, dtype, shape) in layout.regions().items():
            size = torch.Size(shape).numel() * dtype.itemsize
            setattr(self, name, raw[at : at + size].view(dtype).view(shape))
        self._flags_guard: posix.Watchdog | None = None  # the owner's: unlinks the flags' page

    def stream(self):
        """The stream the rounds' glue is queued on (None on CPU, where nothing is queued)."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def warm_up(self) -> None:
        """Run once every kind of kernel the rounds' glue runs on the mailbox (copies, the chain's
        sanitising, the root's gather) and wait. A kernel's first launch loads its module, which waits
        for the whole context: issued while this process's stream waits on the peer's flag, it would
        hold the host until the peer writes, and forever if the peer is dead, where the host must stay
        free to release the wait itself."""
        rows = self.rows.clone()
        tokens = rows[:, 1:]
        torch.nan_to_num(tokens, nan=0.0, posinf=0.0, neginf=0.0, out=tokens).clamp_(0, 1)
        rows[:, 0].copy_(self.ids[:, :1].gather(1, torch.zeros_like(self.ids[:, :1]))[:, 0])
        self.features.clone().copy_(self.features)
        self.counts.clone().copy_(self.counts)
        self.ids.clone()[:, :1].copy_(self.ids[:, :1])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def storage_spec(self) -> RingSpec:
        return self._storage.spec

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @classmethod
    def create(cls, layout: MailboxLayout, device: torch.device | str, wait_s: float = 60.0) -> "RoundMailbox":
        """The verifier's mailbox on ``device`` (its ring's), flags at 0. ``wait_s``: how long a CPU
        host waits for the peer's flag."""
        device = torch.device(device)
        words = -(-layout.nbytes // 4)
        storage = HiddenRing.create(1, words, torch.float32, device)  # shared like the ring, cleaned up like it
        name = f"tandem-flags-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            page = posix.create_segment(name, mmap.PAGESIZE)
            guard = posix.Watchdog([posix.shm_path(name)])
        except BaseException:
            posix.unlink(posix.shm_path(name))
            storage.close()
            raise
        try:
            flags = _flags(page, device, wait_s)
        except BaseException:  # (the driver refused the flags: nothing of the mailbox stays behind)
            guard.stop()
            storage.close()
            raise
        box = cls(layout, storage, flags, name)
        box._flags_guard = guard
        box.warm_up()
        return box

    @classmethod
    def attach(cls, layout: MailboxLayout, storage: RingSpec, flags_name: str) -> "RoundMailbox":
        """The drafter's view of the verifier's mailbox (RingAttachError / OSError when unreachable)."""
        view = HiddenRingView.attach(storage)
        page = posix.open_segment(flags_name, mmap.PAGESIZE)
        box = cls(layout, view, _flags(page, view.tensor.device), flags_name)
        box.warm_up()
        return box

    def close(self, drain_s: float = 10.0) -> None:
        """Drop the flags' pinning and the storage (the owner unlinks both), once the work queued so far
        on this device is done (its waits must have been released): unpinning or unmapping what queued
        work still reads would fault it. Work still queued after ``drain_s`` keeps both (they go with
        the process), with a warning."""
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.default_stream(self.device))  # the legacy stream: after every blocking stream
            deadline = time.monotonic() + drain_s
            while not done.query():
                if time.monotonic() > deadline:
                    log.warning("round mailbox: work queued on %s is still running after %.0f s; leaving the "
                                "mailbox mapped until the process ends", self.device, drain_s)
                    return
                time.sleep(0.001)
        self.flags.close()
        self._storage.close()
        if self._flags_guard is not None:
            self._flags_guard.stop()  # unlinks the page
            self._flags_guard = None


def _flags(page: mmap.mmap, device: torch.device, wait_s: float = 60.0):
    if device.type == "cuda":
        return StreamFlags(page, 2, device)
    return HostFlags(page, 2, wait_s)
