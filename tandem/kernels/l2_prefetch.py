"""Moving a tensor's bytes into the GPU's L2 ahead of the kernel that reads them, from another stream.

A batch-1 decode step is a chain of small dependent kernels; while its latency-bound links run (attention, the split
merge, the routing) the DRAM idles. A weight the chain reads a few links later can be read into the L2 meanwhile, so
that its GEMV reads the L2 instead (bench/l2_prefetch_probe.py measures what that is worth for one GEMV). Nothing is
written: ``cp.async.bulk.prefetch.L2`` (Hopper; one instruction per 64 KB chunk, a thread each) or
``prefetch.global.L2`` (a 128-byte line a thread, any sm_80 on) is a hint the memory system may drop, so the result of
every kernel is the same with or without it. CUDA only; compiled kernels only (the interpreter has no inline PTX).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 65536  # bytes a bulk prefetch moves
LINE = 128  # bytes a line prefetch moves
CHUNKS_PER_PROGRAM = 32  # one warp's threads
LINES_PER_PROGRAM = 512  # four warps', four lines each
VARIANT = "bulk"  # or "line" (sm_80 on)


@triton.jit
def _l2_prefetch_bulk_kernel(ptr, nbytes, CHUNKS: tl.constexpr, CHUNK_BYTES: tl.constexpr):
    offs = (tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)).to(tl.int64) * CHUNK_BYTES
    # each chunk whole, or the tensor's rest in 16-byte units; a chunk past the end prefetches its 16 bytes again
    size = tl.minimum(nbytes - tl.minimum(offs, nbytes - 16), CHUNK_BYTES) // 16 * 16
    p = ptr + tl.minimum(offs, nbytes - 16)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [p, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_line_kernel(ptr, nbytes, LINES: tl.constexpr, LINE_BYTES: tl.constexpr):
    offs = (tl.program_id(0) * LINES + tl.arange(0, LINES)).to(tl.int64) * LINE_BYTES
    p = ptr + tl.minimum(offs, nbytes - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                              is_pure=False, pack=1)


def prefetch_l2(t: torch.Tensor) -> None:
    """Ask the L2 for ``t``'s bytes (contiguous, 16-byte aligned, at least 16 bytes), on the current stream."""
    nbytes = t.numel() * t.element_size()
    if not t.is_contiguous() or t.data_ptr() % 16 or nbytes < 16:
        raise ValueError(f"prefetch_l2 takes a contiguous, 16-byte aligned tensor of 16 bytes or more, got "
                         f"{tuple(t.shape)} {t.dtype} at {t.data_ptr() % 16} past 16-byte alignment")
    as_bytes = t.reshape(-1).view(torch.uint8)
    if VARIANT == "bulk":
        _l2_prefetch_bulk_kernel[(triton.cdiv(nbytes, CHUNK * CHUNKS_PER_PROGRAM),)](
            as_bytes, nbytes, CHUNKS=CHUNKS_PER_PROGRAM, CHUNK_BYTES=CHUNK, num_warps=1)
    else:
        _l2_prefetch_line_kernel[(triton.cdiv(nbytes, LINE * LINES_PER_PROGRAM),)](
            as_bytes, nbytes, LINES=LINES_PER_PROGRAM, LINE_BYTES=LINE, num_warps=4)
