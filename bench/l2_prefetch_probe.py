"""Would a one-row GEMV whose weight was prefetched into the L2 beforehand run faster, and by how much? A batch-1
decode step is a chain of small dependent kernels, most of them waiting on latency with the DRAM idle; if a kernel
on another stream could move the next GEMVs' weights into the L2 during those waits, each GEMV would read the L2
instead of the DRAM. This probe measures the ceiling of that idea before any model is changed: the repo's one-row
GEMV (tandem.kernels.gemv) on a weight that is

    cold        not in the L2 (a 256 MB write in between),
    prefetched  cold, then a prefetch kernel of the variant named (line: ``prefetch.global.L2`` every 128 bytes;
                bulk: ``cp.async.bulk.prefetch.L2`` a 64 KB chunk a thread; load: plain loads summed), then a pause
                of PAUSE_US for the prefetches to land,
    warm        read by the same GEMV just before,

each timed alone with CUDA events (the median of REPS), beside the prefetch kernel's own time and the weight's read
limit at the measured copy rate.

    python3 bench/l2_prefetch_probe.py [--shapes 2048x2048,3648x2048,4096x4096,14336x2048] [--reps 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
sys.path.insert(0, str(Path(__file__).parent))

LINE = 128  # bytes
BULK = 65536  # bytes a bulk prefetch moves
PAUSE_US = 20.0


@triton.jit
def _prefetch_lines_kernel(ptr, n_lines, LINES: tl.constexpr):
    offs = tl.program_id(0) * LINES + tl.arange(0, LINES)
    p = ptr + tl.minimum(offs, n_lines - 1).to(tl.int64) * 128
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_bulk_kernel(ptr, n_chunks, CHUNKS: tl.constexpr):
    offs = tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)
    p = ptr + tl.minimum(offs, n_chunks - 1).to(tl.int64) * 65536
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 65536;\n\tmov.u32 $0, 0;", "=r,l", [p],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_load_kernel(ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(ptr + offs, mask=offs < n, other=0, cache_modifier=".cg")
    s = tl.sum(v, axis=0)
    tl.store(out_ptr + tl.program_id(0) % 4, s, mask=s == 12345)  # never true for random words: keeps the loads


def prefetch(w: torch.Tensor, variant: str, sink: torch.Tensor) -> None:
    nbytes = w.numel() * w.element_size()
    if variant == "line":
        lines = nbytes // LINE
        _prefetch_lines_kernel[(triton.cdiv(lines, 512),)](w, lines, LINES=512, num_warps=4)
    elif variant == "bulk":
        chunks = nbytes // BULK
        _prefetch_bulk_kernel[(triton.cdiv(chunks, 32),)](w, chunks, CHUNKS=32, num_warps=1)
    else:
        words = w.view(torch.int32).view(-1)
        _prefetch_load_kernel[(triton.cdiv(words.numel(), 4096),)](words, sink, words.numel(), BLOCK=4096,
                                                                  num_warps=8)


def main() -> None:
    from measure import read_seconds
    from sections import ceilings
    from tandem.kernels.gemv import gemv

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2048x2048,3648x2048,4096x4096,14336x2048")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--variants", default="line,bulk,load")
    a = ap.parse_args()
    ctx: dict = {}
    ceilings(ctx)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    pause_cycles = int(PAUSE_US * 1.98e3)  # at Hopper's 1.98 GHz boost clock (a little longer below it)
    print(f"{torch.cuda.get_device_name()} copy {ctx['copy_tbps']:.2f} TB/s; pause {PAUSE_US} us", flush=True)
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        want = (x.float() @ w.float().t())
        gemv(x, w, out=out)
        assert torch.allclose(out.float(), want, rtol=2e-2, atol=2e-1), "gemv disagrees"
        limit_us = 1e6 * read_seconds(w.numel() * 2, ctx["copy_tbps"])

        def timed(before) -> float:
            times = []
            for _ in range(a.reps):
                before()
                torch.cuda._sleep(pause_cycles)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                gemv(x, w, out=out)
                end.record()
                end.synchronize()
                times.append(1e3 * start.elapsed_time(end))
            return statistics.median(times)

        def prefetch_alone(variant: str) -> float:
            times = []
            for _ in range(a.reps // 2):
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                prefetch(w, variant, sink)
                end.record()
                end.synchronize()
                times.append(1e3 * start.elapsed_time(end))
            return statistics.median(times)

        cold = timed(lambda: flush.zero_())
        warm = timed(lambda: gemv(x, w, out=out))
        line = f"{n}x{k} bf16 ({w.numel() * 2 / 1e6:.1f} MB, limit {limit_us:.1f} us): cold {cold:.1f} us, warm {warm:.1f}"
        for variant in a.variants.split(","):
            try:
                got = timed(lambda v=variant: (flush.zero_(), prefetch(w, v, sink)))
                line += f", {variant} {got:.1f} (prefetch alone {prefetch_alone(variant):.1f})"
            except Exception as e:  # noqa: BLE001 (a variant the compiler refuses is reported, not fatal)
                line += f", {variant} failed: {type(e).__name__}: {str(e)[:100]}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
