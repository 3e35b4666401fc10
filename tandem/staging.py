"""PinnedStaging: the inputs of a graph replay reach the device in one host→device copy.

A replay's small inputs (token ids, positions, KV slots, block tables, lengths, masks) are packed as
int64 into a pinned host buffer with numpy — no tensor per value — copied to the device in one
non-blocking copy, and scattered into the graph's static buffers there (casting as they go). The
host does not wait for the copy (it is queued behind the device's earlier work, in stream order), so
it can stage the next replay while the device still runs the previous one; the buffer is only
rewritten once the previous copy has read it. Size: the target's buffer holds the largest batch's
block tables (max batch x context / page size values), e.g. 4 MiB at 64 x 128 K tokens / 16.

The other way, ``HostReadback`` queues a run's results to the host as the run is queued, so that
reading them later waits for that run only, not for the run queued after it.
"""

from __future__ import annotations

import numpy as np
import torch


def upload(host: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device``: to a GPU through pinned memory (torch's caching host allocator keeps the block
    until the copy has read it), so the copy is queued behind the device's work instead of waiting for it — a
    pageable ``.to(device)`` synchronises the stream first."""
    t = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class PinnedStaging:
    def __init__(self, numel: int, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.zeros(numel, dtype=torch.int64, pin_memory=cuda)
        self.device_buffer = torch.zeros(numel, dtype=torch.int64, device=device)
        # The last copy (one event, recorded again by each: only the latest copy matters); host is reused after it
        self._copied: torch.cuda.Event | None = torch.cuda.Event() if cuda else None
        self._sent = False

    @property
    def numel(self) -> int:
        return self.host.numel()

    def host_array(self) -> np.ndarray:
        """The host buffer to fill, once the previous copy has read it."""
        if self._sent:
            self._copied.synchronize()
        return self.host.numpy()

    def send(self, count: int) -> torch.Tensor:
        """Copy the first ``count`` values to the device (queued on the current stream); → their device view."""
        dev = self.device_buffer[:count]
        dev.copy_(self.host[:count], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._sent = True
        return dev


def send_page_rows(staging: PinnedStaging, tables: list) -> torch.Tensor:
    """Block tables (one int array of pages per sequence) packed zero-padded into ``staging`` and
    sent → their device view, int64 [n, longest]."""
    n, p = len(tables), max(len(t) for t in tables)
    host = staging.host_array()
    rows = host[: n * p].reshape(n, p)
    rows[:] = 0
    for i, t in enumerate(tables):
        rows[i, : len(t)] = t
    return staging.send(n * p).view(n, p)


class HostReadback:
    """A device tensor's copy to the host, queued now in stream order, read later with ``tolist``.

    A run queued on the device is read back after the next run has been queued behind it (overlapped
    runs): a plain ``.tolist()`` at that point would queue its copy behind the next run too and wait
    for both, leaving the device idle while the host commits. This copy is queued right after the
    run's own work, into pinned memory, and waited for through an event. (On the CPU the work is done
    by the time the run is queued: the copy is the tensor's value then.) The pinned buffer and its event
    go back to a pool of their shape once read (a fresh pinned tensor and event a run were 6-8 % of a served
    engine thread at concurrency 8: bench/spy.py); one never read (an abandoned run) is simply dropped."""

    _pool: dict[tuple, list] = {}  # (shape, dtype, device) -> [(pinned buffer, event)] read and free again
    _pooled_bytes = 0  # what the pool holds (bounded: a run's log-probabilities can take a MiB)

    def __init__(self, tensor: torch.Tensor):
        self.shape = tuple(tensor.shape)
        self._done: torch.cuda.Event | None = None
        self._values: list | None = None
        if tensor.is_cuda:
            self._key = (self.shape, tensor.dtype, tensor.device)
            try:
                self._host, self._done = self._pool.get(self._key, []).pop()
                HostReadback._pooled_bytes -= self._host.nbytes
            except IndexError:
                self._host, self._done = torch.empty(self.shape, dtype=tensor.dtype, pin_memory=True), torch.cuda.Event()
            self._host.copy_(tensor, non_blocking=True)  # (on the tensor's device's current stream: so is the event)
            self._done.record(torch.cuda.current_stream(tensor.device))
        else:
            self._host = tensor.clone()

    def tolist(self) -> list:
        """The tensor's values (waiting for its copy the first time; the same list after)."""
        if self._values is None:
            if self._done is not None:
                self._done.synchronize()
            self._values = self._host.tolist()
            if self._done is not None and HostReadback._pooled_bytes + self._host.nbytes <= _POOLED_BYTES:
                free = self._pool.setdefault(self._key, []) if len(self._pool) < _POOLED_SHAPES else self._pool.get(self._key)
                if free is not None and len(free) < _POOLED_PER_SHAPE:
                    free.append((self._host, self._done))
                    HostReadback._pooled_bytes += self._host.nbytes
            self._host = self._done = None
        return self._values


_POOLED_SHAPES, _POOLED_PER_SHAPE, _POOLED_BYTES = 512, 4, 32 << 20  # bounds on the pool
