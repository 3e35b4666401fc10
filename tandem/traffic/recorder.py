"""TrafficRecorder: collects the features of running requests and hands finished ones to a writer.

The engine calls ``observe`` from its step with the feature rows it just computed (one host copy per
step for the whole batch) and ``finished`` when a request completes. Shards are written by a
background thread (a shard closes at ``shard_samples``, or short once its first sample is ``shard_age_s``
old), so the serving loop never waits on the disk; when the writer falls behind, fails
(a full disk) or the size cap is reached, samples are dropped and counted, never the requests
themselves. Memory is bounded in bytes: a feature row is 3·H values (24 KB per token at the 8B
shape), so shards close at ``shard_mb`` and at most ``queue_mb`` of finished samples wait.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from tandem.traffic.dataset import TrafficManifest, TrafficSample, shard_paths, write_shard

log = logging.getLogger("tandem.traffic")
_STOP = object()


@dataclass(frozen=True)
class CaptureConfig:
    folder: str
    max_gb: float = 50.0  # stop capturing once the folder's shards reach this much (those there at start count)
    shard_samples: int = 256  # samples per shard file, at most
    shard_mb: float = 1024.0  # ... and feature megabytes per shard, at most
    queue_mb: float = 4096.0  # finished samples waiting for the writer before new ones are dropped
    # a shard closes short once its first sample has waited this long: light traffic reaches the disk within minutes,
    # and a verifier killed outright loses at most that much of it
    shard_age_s: float = 300.0


class TrafficRecorder:
    def __init__(self, cfg: CaptureConfig, manifest: TrafficManifest):
        from pathlib import Path

        self.cfg, self.folder = cfg, Path(cfg.folder)
        manifest.write_or_check(self.folder)
        self._rows: dict[str, dict[int, torch.Tensor]] = {}  # rid -> start position -> features [n, W]
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0  # of samples handed to the writer and not yet written (guarded by _lock)
        self._lock = threading.Lock()
        # After the highest existing shard (a deleted one in between must not make us overwrite another).
        self._next_shard = 1 + max((int(p.stem.split("-")[1]) for p in shard_paths(self.folder)), default=-1)
        self.samples_written = self.samples_dropped = 0
        # The cap counts the folder, not this process: a restarted verifier must not write another max_gb.
        self.bytes_written = sum(p.stat().st_size for p in shard_paths(self.folder))
        self._failed = False  # the writer hit an error it cannot recover from: capture stops
        self._writer = threading.Thread(target=self._write_loop, name="traffic-writer", daemon=True)
        self._writer.start()
        log.info("capturing served traffic into %s (shards of %d samples, cap %.1f GB)", self.folder,
                 cfg.shard_samples, cfg.max_gb)

    # -- from the engine (its thread) ------------------------------------------------------------
    def observe(self, features: torch.Tensor, spans: list[tuple[str, int, Sequence[int]]]) -> None:
        """``spans``: (rid, first position, rows of ``features``) — consecutive positions from the first."""
        if not spans:
            return
        rows = [r for _, _, rs in spans for r in rs]
        host = features[torch.tensor(rows, device=features.device)].to("cpu")  # one copy for the step
        at = 0
        for rid, start, rs in spans:  # a copy: a view would keep the whole step's buffer alive per request
            self._rows.setdefault(rid, {})[start] = host[at : at + len(rs)].clone()
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
            self._drop(1)
            return
        sample = TrafficSample(tokens, len(prompt), feats, info)
        with self._lock:
            accept = not self._failed and self._queued_bytes + sample.nbytes <= self.cfg.queue_mb * 1e6
            if accept:
                self._queued_bytes += sample.nbytes
        if accept:
            self._queue.put(sample)
        else:
            self._drop(1)

    def discard(self, rid: str) -> None:
        self._rows.pop(rid, None)

    # -- lifecycle -------------------------------------------------------------------------------
    def _drop(self, count: int) -> None:
        with self._lock:
            self.samples_dropped += count

    def close(self) -> None:
        """Write what is queued (a last, possibly short shard) and stop the writer."""
        self._queue.put(_STOP)
        self._writer.join(timeout=600)
        log.info("traffic capture: %d samples written (the folder holds %.1f MB), %d dropped", self.samples_written,
                 self.bytes_written / 1e6, self.samples_dropped)

    def _write_loop(self) -> None:
        pending: list[TrafficSample] = []
        pending_bytes, due = 0, None  # due: when the pending shard closes however short (shard_age_s)
        while True:
            try:
                item = self._queue.get(timeout=None if due is None else max(0.0, due - time.monotonic()))
            except queue.Empty:
                item = None  # the shard's first sample has waited shard_age_s
            if item is not None and item is not _STOP:
                if not pending:
                    due = time.monotonic() + self.cfg.shard_age_s
                pending.append(item)
                pending_bytes += item.nbytes
            full = len(pending) >= self.cfg.shard_samples or pending_bytes >= self.cfg.shard_mb * 1e6
            if pending and (item is None or item is _STOP or full):
                self._flush(pending)
                with self._lock:
                    self._queued_bytes -= pending_bytes
                pending, pending_bytes, due = [], 0, None
            if item is _STOP:
                return

    def _flush(self, samples: list[TrafficSample]) -> None:
        if self._failed or self.bytes_written >= self.cfg.max_gb * 1e9:
            self._drop(len(samples))
            return
        while (self.folder / f"shard-{self._next_shard:06d}.safetensors").exists():  # another writer's
            self._next_shard += 1
        try:
            path = write_shard(self.folder, self._next_shard, samples)
        except Exception as e:  # noqa: BLE001 - a full disk or a removed folder must not take serving down
            log.error("traffic capture stops: could not write a shard (%s); %d samples dropped", e, len(samples))
            with self._lock:
                self._failed = True
            self._drop(len(samples))
            return
        self._next_shard += 1
        self.samples_written += len(samples)
        self.bytes_written += path.stat().st_size
        if self.bytes_written >= self.cfg.max_gb * 1e9:
            log.warning("traffic capture reached its %.1f GB cap; capturing stops", self.cfg.max_gb)
