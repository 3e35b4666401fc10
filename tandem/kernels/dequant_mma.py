"""W4A16 for 1-16 activation rows (decode, a short verify) with the products on the tensor cores and a
packed unpack. Launched by tandem/kernels/dequant_gemm.py's ``_launch`` for ``DequantConfig(kernel="mma")``,
which also splits K and sums the splits.

The CUDA-core GEMV (tandem/kernels/dequant_gemv.py) spends ~3 instructions a weight at one row (unpack
LOP3 + FFMA, one FFMA a row), more than an SM can issue while reading INT4 at full bandwidth (~37
weights a clock). Here the products go to the tensor cores and the unpack works on pairs:

* Layout: compressed-tensors ``pack-quantized`` as the checkpoint stores it: ``packed [N, K/8]`` int32,
  nibble j of word w is column ``8w + j`` and holds ``q + 8``; ``scale [N, K/GROUP]`` float32, bf16 or fp16 (widened as read).
* Unpack (PTX, ``tl.inline_asm_elementwise``, one word in, eight 16-bit values out): ``lop3`` keeps
  nibbles j and j + 4 of the word (shifted right by 4j) under the exponent bits of 128 (bf16, 1024 for
  fp16), which gives the pair ``128 + nibble`` exactly (the format's spacing there is 1); one
  ``fma.rn.bf16x2`` (``x * 1 - 136``) makes both ``q - 8``, small integers, exact. Three shifts, four
  LOP3, four HFMA2 per 8 weights; ``mov.b32 {lo, hi}`` splits each register into the two outputs.
* Products: ``y^T = Wq @ x^T``: BLOCK_N weight rows are the dot's M (wgmma wants M >= 64), the rows of
  x, padded to BLOCK_M (8 or 16), its N. One ``tl.dot`` per scale group on the exact integers (float32 accumulation),
  then ``acc += part * scale`` in float32: the scale never rounds to the activation dtype.
* Each program owns BLOCK_N rows of W and a K range (split like the GEMV where N leaves too few
  programs); each step's words and scales are loaded one step ahead, the first before the PDL wait
  (weights do not depend on the previous kernel); x, written by the previous kernel, after it.
* Under the Triton interpreter inline PTX cannot run: ``ASM=False`` unpacks with shift / and / convert
  into the same eight tensors and the same tile assembly, so the CPU tests cover the tiling, masks,
  split K and scales; the interpreter multiplies in float32 (its ``tl.dot`` reads bf16 as integers).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tandem.kernels.pdl import pdl_enter


def _unpack_asm(magic: int, bias: int, fma: str) -> str:
    """PTX for one word ($8) → nibbles 0..7 as ``q - 8`` in $0..$7 (16-bit). Register p_j holds nibbles j
    (low half) and j + 4 (high half) of the word."""
    shifts = "".join(f"shr.u32 s{j}, $8, {4 * j};\n" for j in (1, 2, 3))
    pairs = "".join(f"lop3.b32 p{j}, {'$8' if j == 0 else f's{j}'}, 0x000F000F, {magic:#x}, 0xea;\n"
                    f"{fma} p{j}, p{j}, one, bias;\n" for j in range(4))
    split = "".join(f"mov.b32 {{${j}, ${j + 4}}}, p{j};\n" for j in range(4))
    return ("{\n.reg .b32 p0, p1, p2, p3, s1, s2, s3, one, bias;\n"
            f"mov.b32 one, {0x3F803F80 if 'bf16' in fma else 0x3C003C00:#x};\nmov.b32 bias, {bias:#x};\n"
            + shifts + pairs + split + "}")


# (a & b) | c is LOP3's table 0xea; 128 + n and -136 in bf16, 1024 + n and -1032 in fp16
UNPACK_BF16 = tl.constexpr(_unpack_asm(0x43004300, 0xC308C308, "fma.rn.bf16x2"))
UNPACK_FP16 = tl.constexpr(_unpack_asm(0x64006400, 0xE408E408, "fma.rn.f16x2"))



@triton.jit
def _step_loads(w_rows, s_rows, k, K: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """The words ``[BLOCK_N, GROUP/8]`` and scales ``[BLOCK_N]`` of the step's groups from column ``k``,
    as tuples. Where BLOCK_K divides K a step at or past K (a prefetch past the end, a split starting
    past K) reads the last step instead, unmasked (no zeroing, no predicates): its x is masked to zero.
    Otherwise nothing is read past K."""
    offs = tl.arange(0, GROUP // 8)
    words = ()
    scales = ()
    if K % (GROUP * GROUPS) == 0:
        k = tl.minimum(k, K - GROUP * GROUPS)
    for g in tl.static_range(GROUPS):
        kg = k + g * GROUP
        if K % (GROUP * GROUPS) == 0:
            words += (tl.load(w_rows + kg // 8 + offs[None, :]),)
            scales += (tl.load(s_rows + kg // GROUP).to(tl.float32),)
        else:  # the last group's row may end inside it
            w_ok = (kg < K) & (kg // 8 + offs < (K + 7) // 8)[None, :]
            words += (tl.load(w_rows + kg // 8 + offs[None, :], mask=w_ok, other=0),)
            scales += (tl.load(s_rows + kg // GROUP, mask=kg < K, other=0.0).to(tl.float32),)
    return words, scales


@triton.jit
def _assemble(t0, t1, t2, t3, t4, t5, t6, t7):
    """``[BLOCK_N, words]`` x 8 (nibble j of each word) → ``[BLOCK_N, 8 * words]``, column ``8w + c``
    holding nibble 0, 4, 1, 5, 2, 6, 3, 7 for c = 0 .. 7. The dot sums over K in any order, so the
    tile keeps nibbles j and j + 4 adjacent, as the unpack leaves them in one register (no byte
    permutes); x is loaded in the same order (_nibble_of). The outermost join is bit 0 of the column."""
    low = tl.join(tl.join(t0, t2), tl.join(t1, t3))
    high = tl.join(tl.join(t4, t6), tl.join(t5, t7))
    tile = tl.join(low, high)
    return tl.reshape(tile, [t0.shape[0], t0.shape[1] * 8])


@triton.jit
def _nibble_of(c):
    """The column within its word of tile column ``c`` (see _assemble)."""
    return c // 8 * 8 + c % 8 // 2 + c % 2 * 4


@triton.jit
def _unpack(words, DT: tl.constexpr, ASM: tl.constexpr):
    """``q - 8`` of every nibble as a ``[BLOCK_N, 8 * words]`` tile in DT (exact: small integers)."""
    if ASM:
        if DT == tl.bfloat16:
            t = tl.inline_asm_elementwise(UNPACK_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
                                          dtype=(tl.int16,) * 8, is_pure=True, pack=1)
        else:
            t = tl.inline_asm_elementwise(UNPACK_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
                                          dtype=(tl.int16,) * 8, is_pure=True, pack=1)
        return _assemble(t[0].to(DT, bitcast=True), t[1].to(DT, bitcast=True), t[2].to(DT, bitcast=True),
                         t[3].to(DT, bitcast=True), t[4].to(DT, bitcast=True), t[5].to(DT, bitcast=True),
                         t[6].to(DT, bitcast=True), t[7].to(DT, bitcast=True))
    else:
        return _assemble(((words & 0xF) - 8).to(DT), (((words >> 4) & 0xF) - 8).to(DT),
                         (((words >> 8) & 0xF) - 8).to(DT), (((words >> 12) & 0xF) - 8).to(DT),
                         (((words >> 16) & 0xF) - 8).to(DT), (((words >> 20) & 0xF) - 8).to(DT),
                         (((words >> 24) & 0xF) - 8).to(DT), (((words >> 28) & 0xF) - 8).to(DT))


@triton.jit
def _dequant_mma_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_ym, stride_ys,
    K: tl.constexpr, K_SPLIT: tl.constexpr, STRIDE_W: tl.constexpr, STRIDE_S: tl.constexpr, GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ASM: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """Rows ``pid_m * BLOCK_M ..`` of x times rows ``pid_n * BLOCK_N ..`` of W over columns
    ``pid_s * K_SPLIT ..`` (float32 partial sums at ``y_ptr + pid_s * stride_ys`` where K is split).
    BLOCK_K is a multiple of GROUP, K_SPLIT of BLOCK_K. The last N tile re-reads valid rows (only its
    store is masked)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    DT: tl.constexpr = tl.float32 if INTERPRET else x_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    k_begin = pid_s * K_SPLIT
    w_rows = w_ptr + rows[:, None] * STRIDE_W
    s_rows = s_ptr + rows * STRIDE_S
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm
    words, scales = _step_loads(w_rows, s_rows, k_begin, K, GROUP, GROUPS)
    pdl_enter(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kk in tl.range(0, K_SPLIT, BLOCK_K, loop_unroll_factor=2):  # unrolled: no moves to hand the prefetch over
        k = k_begin + kk
        # the next step's weights (past the program's range: a valid re-read, never used)
        words_next, scales_next = _step_loads(w_rows, s_rows, k + BLOCK_K, K, GROUP, GROUPS)
        for g in tl.static_range(GROUPS):
            offs_k = k + g * GROUP + _nibble_of(tl.arange(0, GROUP))  # the tile's column order
            xg = tl.load(x_cols + offs_k[:, None], mask=m_ok[None, :] & (offs_k < K)[:, None], other=0.0)
            tile = _unpack(words[g], DT, ASM)
            if INTERPRET:
                part = tl.dot(tile, xg.to(DT), input_precision="ieee")
            else:
                part = tl.dot(tile, xg.to(DT))
            acc += part * scales[g][:, None]
        words = words_next
        scales = scales_next
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
    y_ptrs = y_ptr + pid_s.to(tl.int64) * stride_ys + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[None, :] & (offs_n < N)[:, None])
