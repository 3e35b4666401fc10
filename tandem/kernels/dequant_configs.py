"""Which quantized-linear kernel and tile a call takes (tandem/kernels/dequant_gemm.py launches them): ``DequantConfig``
and ``default_config`` by rows, weight shape, format and activation dtype, with the measurements behind each
threshold beside it; ``mma_config`` / ``mma_sync_config`` for the tensor-core kernels for few rows."""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch
import triton

from tandem.kernels.dequant_tiles import INT4, PLAIN, interpreting


@dataclass(frozen=True)
class DequantConfig:
    block_m: int = 16
    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    # "dot": tensor cores, rows padded to block_m >= 16; "rows": CUDA cores, block_m 1; "gemv": CUDA cores,
    # up to block_m (1 to 4) rows a program (tandem/kernels/dequant_gemv.py); "mma": INT4 only, tensor cores
    # with W's rows as the dot's M, 8 or 16 rows of x a program (tandem/kernels/dequant_mma.py); "mma_sync": INT4
    # groups of 32, bf16, mma.sync fed from registers, 8 rows of x a program (tandem/kernels/dequant_mma_sync.py,
    # block_n 64 or 128, block_k a multiple of 128). (num_stages, for
    # "gemv": K steps of the weight in flight, the one multiplied included; 1 and 2 are the same)
    kernel: str = "dot"
    # "gemv" over one K range of whole steps: the read-ahead past the last step re-reads it unmasked instead of a
    # masked load (tandem/kernels/dequant_gemv.py's MASKED); default_config's choice: CLAMPED_STEPS
    clamped_read_ahead: bool = False

    def __post_init__(self):
        rows_ok = {"dot": self.block_m >= 16, "rows": self.block_m == 1, "gemv": 1 <= self.block_m <= 4,
                   "mma": self.block_m in (8, 16), "mma_sync": self.block_m == MMA_SYNC_ROWS}
        if not rows_ok.get(self.kernel, False):
            raise ValueError("DequantConfig: kernel 'dot' takes block_m >= 16, 'rows' block_m 1, 'gemv' block_m "
                             f"1 to 4, 'mma' block_m 8 or 16, 'mma_sync' block_m 8; got {self}")


PROGRAMS_WANTED = 264  # two per H200 SM: fewer programs keep too few loads in flight to reach the bandwidth
# One row over a long K: the CUDA-core kernel, 4 rows of W by 1024 columns a step. Measured on the H200
# (bench --sections quant_kernels, INT4 and FP8): 2.0-3.2x faster than the tensor-core tiles at K 7168 and
# 14336; slower at K 2048 and 4096.
ROWS_KERNEL_MIN_K = 7168
# Rows up to which default_config takes the bandwidth-minded GEMV kernel (tandem/kernels/dequant_gemv.py);
# 0 gives the tiles above instead (bench/sections_quant.py times both). On the H200 the GEMV won at one row
# everywhere and at four rows for INT4 everywhere; FP8 at 2-4 rows lost on the largest weight (8B gate_up,
# 28672 x 4096: 71.0 against 46.2 us), where each row's multiply-add per weight on CUDA cores costs more than
# the tensor-core tile's reuse: FP8 takes the GEMV for 2-4 rows only below FP8_GEMV_MAX_ELEMENTS weights.
GEMV_MAX_ROWS = 4
# INT4 in groups of 32 with bf16 activations at MMA_SYNC_MIN_ROWS to MMA_SYNC_MAX_ROWS rows (default_config; not expert
# slots) takes the register-fed mma.sync kernel (tandem/kernels/dequant_mma_sync.py), MMA_SYNC_BLOCK_N rows of W a
# program. Measured (H100, bench --sections quant_engines, INT4 8B, in process): batch-8 decode 1981 tok/s (1002 with
# the wgmma kernel), a chain's 4-row verify at τ 4 800 against 693 tok/s with the GEMV; at one row the GEMV wins (378
# against 261 tok/s); at 2 rows the GEMV wins (bench/int4_gemv_sweep.py --rows: 8B down 20.4 against 25.5 us, gate_up
# 35.0 against 44.7), at 3 rows 8B down is even: 1-3 rows keep the GEMV; K not a multiple of 128 (its masked loads
# pass the GPU tests, their speed untimed) left to the others
MMA_SYNC_MIN_ROWS = 4
MMA_SYNC_MAX_ROWS = 8
# One INT4 row through a dense linear (not expert slots): (block_n, K steps in flight) below and from
# ONE_ROW_INT4_LONG_K columns. Measured (H100, 8B shape, bench/int4_gemv_sweep.py, then in the model with
# bench/profile_deepseek.py --quant-tile, two interleaved runs each): gate_up 25.9 against 26.9 us, o 5.1 against 5.7
# at (8, 3); down (K 14336) 15.0 against 16.2 at (4, 4), where (8, 3) was slower (17.4); the 8B's batch-1 step 2448-2451
# against 2522-2528 us with gate_up and down so (the earlier (8, 1) everywhere)
ONE_ROW_INT4_TILE, ONE_ROW_INT4_LONG_TILE, ONE_ROW_INT4_LONG_K = (8, 3), (4, 4), 8192
MMA_SYNC_BLOCK_N = 128
# What the mma_sync kernel is built for (tandem/kernels/dequant_mma_sync.py reads them from here): scale groups of 32
# columns (one A fragment's K span is a group's four words), steps of 4 groups, 8 rows of x a program (mma's N)
MMA_SYNC_GROUP = 32
MMA_SYNC_STEP = 4 * MMA_SYNC_GROUP
MMA_SYNC_ROWS = 8
FP8_GEMV_MAX_ELEMENTS = 64 << 20
# K steps (one K range) over which the GEMV re-reads its last step instead of masking its read-ahead
# (DequantConfig.clamped_read_ahead); None: nowhere. The sm_90 SASS (compile_check, INT4, one row) favours 3 to 8: at
# 4 steps (the 8B's K 4096) 1016 instructions and 77 registers against 1072 and 96; 7 steps 1144 against 1176 at 128
# registers; 2 steps (K 2048) 616 against 512; 14 steps (K 14336) 124 registers against 63. Off until a GPU times it
# (bench/int4_gemv_sweep.py's "flipped" row, bench/profile_deepseek.py --clamped-read-ahead): no GPU was lent since
CLAMPED_STEPS: tuple[int, int] | None = None
GEMV_MIN_PROGRAMS = 396  # three per H200 SM: the GEMV splits K until its grid has this many programs
# INT4 with bf16/fp16 activations, more rows than the GEMV takes and up to INT4_MMA_MAX_ROWS: the "mma" kernel
# (tandem/kernels/dequant_mma.py). On the H200 (bench --sections quant_kernels, 16 rows) it took 0.5-0.6x the time of
# the tiles below on four of five shapes, and 1.07x on the largest (8B gate_up, 117 Mi weights), which keeps the
# tiles (INT4_MMA_MAX_ELEMENTS); at 1-4 rows the GEMV was 2-3.5x faster than it.
INT4_MMA_MAX_ROWS = 16
INT4_MMA_MAX_ELEMENTS = 64 << 20


def _gemv_split(programs: int, steps: int) -> int:
    """The fewest K splits that give GEMV_MIN_PROGRAMS programs, preferring (up to twice as many) splits
    that divide the K steps evenly: the slowest split sets the time."""
    enough = [s for s in range(1, steps + 1) if programs * s >= GEMV_MIN_PROGRAMS]
    if not enough:
        return steps
    even = [s for s in enough if steps % s == 0 and s <= 2 * enough[0]]
    return even[0] if even else enough[0]


def default_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                   gemv_max_rows: int | None = None, fmt: int = INT4, group: int | None = None,
                   slots: bool = False) -> DequantConfig:
    """INT4 in ``group``s of 32 (the scale groups' columns, where the caller knows them) with bf16 activations at
    MMA_SYNC_MIN_ROWS to MMA_SYNC_MAX_ROWS rows and K a multiple of 128: the register-fed mma.sync kernel.
    Up to ``gemv_max_rows`` (default GEMV_MAX_ROWS) rows: the GEMV kernel, 8 rows of W by 1024 (INT4, and
    FP8 at one row) or 512 (FP8 at 2-4 rows) columns a step: one 32-bit word of each row per thread of 4 warps
    (FP8 at 1024 columns holds twice the registers, which several rows cannot afford); K split where N leaves
    too few programs (GEMV_MIN_PROGRAMS); one INT4 row of a dense linear (``slots`` False: not expert slots) keeps
    more K steps in flight (ONE_ROW_INT4_TILE).
    Otherwise few rows: narrow N tiles (16 rows of W where 32 would leave fewer than PROGRAMS_WANTED
    programs) and wide K steps, so that enough loads are in flight to stream the weight; more rows:
    wider tiles that reuse each dequantized weight tile for more rows. float32 (full-precision
    products, no tensor cores) takes small tiles that fit in registers. bench/sections_quant.py times
    alternatives."""
    gemv_rows = GEMV_MAX_ROWS if gemv_max_rows is None else gemv_max_rows
    if (fmt == INT4 and group == MMA_SYNC_GROUP and dtype == torch.bfloat16 and gemv_max_rows is None
            and k % MMA_SYNC_STEP == 0 and MMA_SYNC_MIN_ROWS <= m <= MMA_SYNC_MAX_ROWS and not interpreting() and gluon_available()):
        return mma_sync_config(m, n, k)
    if (fmt == INT4 and gemv_max_rows is None and gemv_rows < m <= INT4_MMA_MAX_ROWS and n * k < INT4_MMA_MAX_ELEMENTS
            and dtype != torch.float32):
        return mma_config(m, n, k)
    if fmt != INT4 and gemv_max_rows is None and n * k >= FP8_GEMV_MAX_ELEMENTS:
        gemv_rows = min(gemv_rows, 1)
    if m <= gemv_rows:
        rows = m
        # INT4 and plain (moe slots' bf16: 8 weights a thread) at 1024 columns: 4 warps' threads one word each;
        # FP8 at one row too (bench/int4_gemv_sweep.py: faster on 4 of its 5 shapes), at 2-4 rows 512 (registers)
        block_k = min(1024 if fmt in (INT4, PLAIN) or m == 1 else 512, max(64, triton.next_power_of_2(k)))
        if interpreting():  # the CPU tests' interpreter runs programs one after another: fewer, wider ones
            return DequantConfig(rows, 32, block_k, num_warps=4, num_stages=1, kernel="gemv")
        block_n, stages = 8, 1
        if fmt == INT4 and m == 1 and not slots:
            block_n, stages = ONE_ROW_INT4_LONG_TILE if k >= ONE_ROW_INT4_LONG_K else ONE_ROW_INT4_TILE
        steps = triton.cdiv(k, block_k)
        split = _gemv_split(triton.cdiv(n, block_n) * triton.cdiv(m, rows), steps)
        return DequantConfig(rows, block_n, block_k, num_warps=4, num_stages=stages, split_k=split, kernel="gemv",
                             clamped_read_ahead=CLAMPED_STEPS is not None
                             and CLAMPED_STEPS[0] <= steps <= CLAMPED_STEPS[1])
    if dtype == torch.float32:
        return DequantConfig(16 if m <= 16 else 32, 32, 32, num_warps=4, num_stages=2)
    if m == 1 and k >= ROWS_KERNEL_MIN_K:
        return DequantConfig(1, 4, 1024, num_warps=4, num_stages=3, kernel="rows")
    if m <= 16:
        block_n, block_k = (32 if triton.cdiv(n, 32) >= PROGRAMS_WANTED else 16), 256
        programs, split = triton.cdiv(n, block_n) * triton.cdiv(m, 16), 1
        while programs * split < PROGRAMS_WANTED // 2 and k // (2 * split) >= 2 * block_k:
            split *= 2
        return DequantConfig(16, block_n, block_k, num_warps=4, num_stages=4, split_k=split)
    if m <= 64:
        return DequantConfig(64, 64, 64, num_warps=4, num_stages=3)
    return DequantConfig(64, 128, 64, num_warps=8, num_stages=3)


@functools.lru_cache(maxsize=1)
def gluon_available() -> bool:
    """Whether this Triton has Gluon (3.5 on), which the mma_sync kernel is written in; an older one (torch 2.4-2.8's)
    keeps the other kernels."""
    return importlib.util.find_spec("triton.experimental.gluon") is not None


def mma_sync_config(m: int, n: int, k: int, block_n: int = MMA_SYNC_BLOCK_N,
                    split: int | None = None) -> DequantConfig:
    """The "mma_sync" kernel's tile: ``block_n`` rows of W and up to MMA_SYNC_ROWS rows of x a program, steps of
    MMA_SYNC_STEP columns, K split in ``split`` or, by default, like the GEMV's where N leaves too few programs."""
    if split is None:
        split = _gemv_split(triton.cdiv(n, block_n) * triton.cdiv(m, MMA_SYNC_ROWS), triton.cdiv(k, MMA_SYNC_STEP))
    return DequantConfig(MMA_SYNC_ROWS, block_n, MMA_SYNC_STEP, num_warps=4, num_stages=1, split_k=split,
                         kernel="mma_sync")


def mma_config(m: int, n: int, k: int, block_n: int = 64, block_k: int = 256) -> DequantConfig:
    """The "mma" kernel's tile: one warpgroup's 64 rows of W (wgmma's M) by 256 columns a step, the rows of x
    padded to 16, K split like the GEMV's where N leaves too few programs. (8 rows of x would halve the float32
    accumulator the scales multiply, but Triton then takes mma.sync instead of wgmma, with more instructions a
    weight in the SASS: bench/sections_quant.py times both.)"""
    rows = 16
    if interpreting():
        return DequantConfig(rows, block_n, block_k, num_warps=4, num_stages=1, kernel="mma")
    split = _gemv_split(triton.cdiv(n, block_n) * triton.cdiv(m, rows), triton.cdiv(k, block_k))
    return DequantConfig(rows, block_n, block_k, num_warps=4, num_stages=1, split_k=split, kernel="mma")
