"""cuBLAS's first calls in a process, moved off the graph capture's path.

The first time a process multiplies at a given shape, cuBLAS loads the kernel it picks (lazily, from its ~500 MB
library) and runs its heuristics: at a DeepSeek-V2-Lite target's first start, 0.8-2.7 s of its capture
(docs/benchmarks.md, "Graph capture", with and without this module). Which shapes a capture multiplies at depends on
the model and the graph families, so a capture records them (``MatmulShapes``: the matrix products its eager
warm-ups and captures run, by op, shape, strides and dtype) into a file of the cache, keyed by everything that
decides them; the next start of the same configuration replays them on uninitialised tensors in a thread while the
weights load (torch releases the GIL inside an op), and the capture finds the kernels loaded and the heuristics'
answers cached. What a replay computes is thrown away; one that fails is skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.model_source import cache_root

log = logging.getLogger("tandem.matmul_warm")

ENABLED = True  # bench/capture_phases.py's "-cold-blas" labels time a start without the replay
# the products recorded (composites as called under inference mode: replayed alike, they decompose alike)
RECORDED_OPS = frozenset({"aten.linear.default", "aten.matmul.default", "aten.mm.default", "aten.addmm.default",
                          "aten.bmm.default", "aten.baddbmm.default", "aten.einsum.default"})
MAX_REPLAY_BYTES = 1 << 30  # a product with larger operands is not replayed (while the weights load, memory is dear)


def shapes_file(*decided_by: object) -> Path:
    """The cache file of the products a configuration's capture runs: named by a hash of what decides them (the
    engine and model configurations, the device; torch's version, and Tandem's code as its files' sizes and times,
    so that a changed code records afresh)."""
    package = Path(__file__).parent
    code = sorted((str(f.relative_to(package)), f.stat().st_size, f.stat().st_mtime_ns) for f in package.rglob("*.py"))
    text = repr((decided_by, torch.__version__, code))
    return cache_root() / "matmul-shapes" / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"


def _describe(value):
    """An op argument as JSON: a tensor by shape, strides, storage offset and dtype; lists item by item."""
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "stride": list(value.stride()), "offset": value.storage_offset(),
                "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"not recorded: {type(value).__name__}")


def _storage(value: dict) -> int:
    """The elements a described tensor's storage holds: its offset and the span its shape and strides reach."""
    shape = value["shape"]
    return value["offset"] + (1 + sum((n - 1) * s for n, s in zip(shape, value["stride"])) if all(shape) else 0)


def _build(value, device: torch.device):
    """``_describe``'s inverse, on uninitialised memory of ``device``."""
    if isinstance(value, dict):
        base = torch.empty(_storage(value), dtype=getattr(torch, value["dtype"]), device=device)
        return base.as_strided(value["shape"], value["stride"], value["offset"])
    if isinstance(value, list):
        return [_build(v, device) for v in value]
    return value


def _bytes(value) -> int:
    if isinstance(value, dict):
        return _storage(value) * getattr(torch, value["dtype"]).itemsize
    return sum(_bytes(v) for v in value) if isinstance(value, list) else 0


class MatmulShapes(TorchDispatchMode):
    """While active, records each distinct product (``RECORDED_OPS``) run: [op, args, kwargs] described."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, list] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in RECORDED_OPS:
            try:
                entry = [name, _describe(list(args)), {k: _describe(v) for k, v in (kwargs or {}).items()}]
                self.seen.setdefault(json.dumps(entry, sort_keys=True), entry)
            except TypeError:
                pass  # an argument of a kind not replayed: the product stays cold
        return func(*args, **(kwargs or {}))

    def save(self, path: Path) -> None:
        """Write the products seen to ``path`` (atomically: ranks of a group may write the same file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        part.write_text(json.dumps(list(self.seen.values())))
        os.replace(part, path)


def replay(entries: list, device: torch.device) -> int:
    """Run each recorded product once on uninitialised tensors of ``device`` (a stream of its own); → how many ran."""
    ran = 0
    if device.type == "cuda":
        torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.inference_mode(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        for name, args, kwargs in entries:
            if _bytes(args) + _bytes(list(kwargs.values())) > MAX_REPLAY_BYTES:
                continue
            try:
                op = getattr(torch.ops.aten, name.split(".")[1])
                op(*_build(args, device), **{k: _build(v, device) for k, v in kwargs.items()})
                ran += 1
            except Exception as e:  # a stale or odd entry costs nothing but itself
                log.debug("matmul warm-up: %s skipped (%s: %s)", name, type(e).__name__, e)
    if stream is not None:
        stream.synchronize()
    return ran


class MatmulWarm:
    """One start's warm-up of the products its capture will run: ``start`` replays a recorded file in a thread (the
    weights load meanwhile), ``join`` waits for it and hands its spare memory back (before the KV cache is sized),
    ``recording`` records a capture's products when there was no file, and ``save`` writes them."""

    def __init__(self, path: Path, device: torch.device):
        self.path, self.device = path, device
        self.thread: threading.Thread | None = None
        self.recorder: MatmulShapes | None = None
        self.ran, self.seconds = 0, 0.0  # products replayed, in how long

    def start(self) -> MatmulWarm:
        if not ENABLED:
            return self
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.recorder = MatmulShapes()  # none recorded (or unreadable): this start's capture records them
            return self
        started = time.perf_counter()

        def run():
            self.ran = replay(entries, self.device)
            self.seconds = time.perf_counter() - started
            log.info("matmul warm-up: %d of %d products in %.2f s", self.ran, len(entries), self.seconds)

        self.thread = threading.Thread(target=run, name="matmul-warm", daemon=True)
        self.thread.start()
        return self

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            if self.device.type == "cuda":
                # cuBLAS keeps a workspace per handle and stream, the thread's for good: dropped (a later call on
                # the main thread makes its own); its operands' blocks belong to its stream, which nothing else uses
                clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
                if clear_workspaces is not None:
                    clear_workspaces()
                torch.cuda.empty_cache()

    def recording(self):
        return self.recorder if self.recorder is not None else contextlib.nullcontext()

    def save(self) -> None:
        if self.recorder is not None and self.recorder.seen:
            try:
                self.recorder.save(self.path)
            except OSError as e:  # a read-only cache only costs the next start its warm-up
                log.warning("matmul warm-up: could not record the capture's products in %s (%s)", self.path, e)
            self.recorder = None
