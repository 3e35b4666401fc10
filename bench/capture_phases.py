"""Where a many-layer target's graph capture time goes: DeepSeek-V2-Lite's shape (random bf16 weights drawn on the
GPU, bench/sections_deepseek.py's folder), its engine started once per label in one process, each start's capture
summed per family and split into its phases (padding + eager warm-ups, the capture itself, the first replay that
uploads the graph). A label ``F/L`` warms a member up F times at its first (largest) bucket and L times at the
others; ``code`` runs the engine's own capture, untimed by phase, then decodes at batch 1; ``cold`` is ``2/2`` meant
for a fresh process (Triton compiles). A suffix after ``-`` only names a repeat, but ``-late``: Triton's
installation hash left to the capture's first lookup (triton_start.EARLY off; in a fresh process: it is made once);
``-cold-blas``: cuBLAS's first calls left to the capture (matmul_warm.ENABLED off; the first start records them).
  usage: python3 bench/capture_phases.py cold            (first, in a process of its own: the kernels compile)
         python3 bench/capture_phases.py 2/2 2/1 2/2-again code"""

from __future__ import annotations

import collections
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from engine_rows import random_weight_engine  # noqa: E402
from measure import decode_tok_s, free_gpu  # noqa: E402
from sections_deepseek import V2_LITE, deepseek_dir  # noqa: E402
from tandem.graph_capture import GraphRunner, capture_stream  # noqa: E402
from tandem import matmul_warm  # noqa: E402
from tandem.kernels import triton_start  # noqa: E402

phases: dict = collections.defaultdict(float)
warmups = {"first": 2, "later": 2}
_seen: set = set()


def timed_capture_one(self, member, bs: int, _warmups: int) -> torch.cuda.CUDAGraph:
    """GraphRunner._capture_one with a synchronisation between its phases, each timed into ``phases``."""
    t0 = time.perf_counter()
    self._pad_all(member, bs)
    stream = capture_stream(self.device)
    stream.wait_stream(torch.cuda.current_stream(self.device))
    runs = warmups["first"] if (id(self), member) not in _seen else warmups["later"]
    _seen.add((id(self), member))
    with torch.cuda.stream(stream):
        for _ in range(runs):
            self._body(member, bs)
    torch.cuda.current_stream(self.device).wait_stream(stream)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    if self.pool is None:
        self.pool = torch.cuda.graph_pool_handle()
    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
        self._body(member, bs)
    t2 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    phases["pad+warm"] += t1 - t0
    phases["capture"] += t2 - t1
    phases["upload"] += time.perf_counter() - t2
    phases["graphs"] += 1
    return graph


def main() -> None:
    engine_capture = GraphRunner._capture_one
    path = deepseek_dir("v2-lite-27l", V2_LITE)
    for label in sys.argv[1:] or ["code"]:
        kind = label.split("-")[0]
        triton_start.EARLY = "-late" not in label
        matmul_warm.ENABLED = "-cold-blas" not in label
        if kind == "code":
            GraphRunner._capture_one = engine_capture
        else:
            first, later = (2, 2) if kind == "cold" else map(int, kind.split("/"))
            warmups.update(first=first, later=later)
            GraphRunner._capture_one = timed_capture_one
        phases.clear()
        _seen.clear()
        started = time.perf_counter()
        engine = random_weight_engine(path, (1, 4), 64, kv_pages=2048)
        start_s = time.perf_counter() - started
        report, warm = engine.executor.runner.graph_report, engine.executor.runner.matmul_warm
        print(f"{label}: start {start_s:.1f} s, capture sum {sum(s for s, _ in report.values()):.2f} s; cuBLAS warm-up "
              f"{warm.ran} products in {warm.seconds:.2f} s; phases "
              f"{ {k: round(v, 2) for k, v in phases.items()} }", flush=True)
        print("   ", {name: round(s, 2) for name, (s, _) in report.items()}, flush=True)
        if kind == "code":  # (the engine's own graphs serve: plain decode at batch 1 on them)
            decode_tok_s(engine, 1, 8)
            print(f"    decode at batch 1: {decode_tok_s(engine, 1, 64)['tok_s']:.1f} tok/s", flush=True)
        engine.shutdown()
        del engine
        free_gpu()


if __name__ == "__main__":
    main()
