"""The host's time for a fresh graph replay's input scatter (GraphFamily.scatter): the torch copies against the
one kernel (tandem/kernels/stage_inputs.py), at batch 8 and 64, widths 1 and 4 (masked), two table widths; per call,
the best of five loops of 500 calls queued without waiting, and the stream's time for 100 queued.
  usage: python3 bench/stage_scatter.py"""

from __future__ import annotations

import itertools
import os
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from tandem.engine.graph_buffers import GraphFamily, scatter_with_torch  # noqa: E402
from tandem.kernels.stage_inputs import scatter_staged  # noqa: E402


def per_call(f) -> tuple[float, float]:
    """(host µs a call, stream µs a call over 100 queued)."""
    for _ in range(50):
        f()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(500):
            f()
        best = min(best, (time.perf_counter() - started) / 500)
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        f()
    end.record()
    end.synchronize()
    return 1e6 * best, 10 * start.elapsed_time(end)


def main() -> None:
    for width, n, bs, pages, cols in [(1, 8, 8, 6, 2048), (1, 60, 64, 6, 2048), (4, 8, 8, 6, 2048), (1, 8, 8, 6, 8192)]:
        fam = GraphFamily(width, 64, cols, 16, torch.device("cuda"))
        sizes = [bs * width] * 3 + [bs, n * pages, n * width * width if width > 1 else 0]
        bounds = list(itertools.accumulate(sizes, initial=0))
        sent = torch.randint(0, 2, (bounds[-1],), device="cuda")
        copies = per_call(lambda: scatter_with_torch(fam, sent, bounds, n, bs, pages))
        kernel = per_call(lambda: scatter_staged(sent, fam.input_ids, fam.positions, fam.slots, fam.kv_lens,
                                                 fam.block_tables, fam.mask, n, bs, width, pages, 0))
        print(f"width {width} n {n} bs {bs} pages {pages} table cols {cols}: host µs a call torch {copies[0]:.1f} "
              f"kernel {kernel[0]:.1f}; stream µs a call (100 queued) torch {copies[1]:.1f} kernel {kernel[1]:.1f}",
              flush=True)


if __name__ == "__main__":
    main()
