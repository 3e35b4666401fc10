"""TrafficRecorder: collects the features of running requests and hands finished ones to a writer.

The engine calls ``observe`` from its step with the feature rows it just computed (one host copy per
step for the whole batch) and ``finished`` when a request completes. Shards are written by a
background thread, so the serving loop never waits on the disk; when the writer falls behind (or the
size cap is reached) samples are dropped and counted, never the requests themselves.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from tandem.traffic.dataset import TrafficManifest, TrafficSample, shard_paths, write_shard

log = logging.getLogger("tandem.traffic")
_STOP = object()


@dataclass(frozen=True)
class CaptureConfig:
    folder: str
    max_gb: float = 50.0  # stop capturing once this much was written by this process
    shard_samples: int = 256  # samples per shard file
    queue_samples: int = 1024  # finished samples waiting for the writer before new ones are dropped


class TrafficRecorder:
    def __init__(self, cfg: CaptureConfig, manifest: TrafficManifest):
        from pathlib import Path

        self.cfg, self.folder = cfg, Path(cfg.folder)
        manifest.write_or_check(self.folder)
        self._rows: dict[str, dict[int, torch.Tensor]] = {}  # rid -> start position -> features [n, W]
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.queue_samples)
        self._next_shard = len(shard_paths(self.folder))
        self.samples_written = self.samples_dropped = self.bytes_written = 0
        self._writer = threading.Thread(target=self._write_loop, name="traffic-writer", daemon=True)
        self._writer.start()
        log.info("capturing served traffic into %s (shards of %d samples, cap %.1f GB)", self.folder,
                 cfg.shard_samples, cfg.max_gb)

    # -- from the engine (its thread) ------------------------------------------------------------
    def observe(self, features: torch.Tensor, spans: list[tuple[str, int, list[int]]]) -> None:
        """``spans``: (rid, first position, rows of ``features``) — consecutive positions from the first."""
        if not spans:
            return
        rows = [r for _, _, rs in spans for r in rs]
        host = features[torch.tensor(rows, device=features.device)].to("cpu")  # one copy for the step
        at = 0
        for rid, start, rs in spans:
            self._rows.setdefault(rid, {})[start] = host[at : at + len(rs)]
            at += len(rs)

    def finished(self, rid: str, prompt: list[int], output: list[int], info: dict) -> None:
        chunks = self._rows.pop(rid, None)
        tokens = prompt + output
        if chunks is None or len(tokens) < 2:
            return
        width = next(iter(chunks.values())).shape[1]
        feats = torch.empty(len(tokens) - 1, width, dtype=next(iter(chunks.values())).dtype)
        covered = torch.zeros(len(tokens) - 1, dtype=torch.bool)
        for start in sorted(chunks):  # later positions (and a recompute after preemption) overwrite
            part = chunks[start][: max(0, len(tokens) - 1 - start)]
            feats[start : start + part.shape[0]] = part
            covered[start : start + part.shape[0]] = True
        if not bool(covered.all()):  # a step ran without capture: an incomplete sample would mislead training
            self.samples_dropped += 1
            return
        try:
            self._queue.put_nowait(TrafficSample(tokens, len(prompt), feats, info))
        except queue.Full:
            self.samples_dropped += 1

    def discard(self, rid: str) -> None:
        self._rows.pop(rid, None)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Write what is queued (a last, possibly short shard) and stop the writer."""
        self._queue.put(_STOP)
        self._writer.join(timeout=60)
        log.info("traffic capture: %d samples written (%.1f MB), %d dropped", self.samples_written,
                 self.bytes_written / 1e6, self.samples_dropped)

    def _write_loop(self) -> None:
        pending: list[TrafficSample] = []
        while True:
            item = self._queue.get()
            if item is not _STOP:
                pending.append(item)
            if pending and (item is _STOP or len(pending) >= self.cfg.shard_samples):
                self._flush(pending)
                pending = []
            if item is _STOP:
                return

    def _flush(self, samples: list[TrafficSample]) -> None:
        if self.bytes_written >= self.cfg.max_gb * 1e9:
            self.samples_dropped += len(samples)
            return
        try:
            path = write_shard(self.folder, self._next_shard, samples)
        except OSError as e:  # a full disk must not take serving down
            log.error("traffic capture: could not write a shard (%s); %d samples dropped", e, len(samples))
            self.samples_dropped += len(samples)
            return
        self._next_shard += 1
        self.samples_written += len(samples)
        self.bytes_written += path.stat().st_size
        if self.bytes_written >= self.cfg.max_gb * 1e9:
            log.warning("traffic capture reached its %.1f GB cap; capturing stops", self.cfg.max_gb)
