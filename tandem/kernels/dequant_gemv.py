"""The quantized linear product for 1-4 rows (batch-1 decode, short verify) on the CUDA cores, written to
stream the packed weight at the read bandwidth. Launched by tandem/kernels/dequant_gemm.py's ``_launch``
for ``DequantConfig(kernel="gemv")``, which also splits K and sums the splits.

At a few rows a quantized GEMV is ~1 multiply-add per weight and row, but an INT4 weight is half a
byte: to read 4.8 TB/s an H200 SM must turn ~37 weights a clock into products, with 128 instruction
issues a clock. So the unpacking must cost ~2 instructions a weight, and each SM must keep tens of KB
of loads in flight. The design (instruction counts: the SASS of tandem/kernels/compile_check.py):

* Each program owns ``BLOCK_N`` rows of W and walks its K range in ``BLOCK_K`` steps, reading the
  checkpoint layout as it is (never repacked). A thread owns one 32-bit word of a row (8 INT4 or 4 FP8
  weights) in every row of the tile; a warp's load of a row is 128 contiguous bytes. The activation
  columns of a thread's word are one vector load, split in registers, shared by the tile's rows.
* ``AHEAD`` steps' weights and scales are loaded before the current step is multiplied (the first step is
  read before the PDL wait: weights do not depend on the previous kernel); the loop is unrolled AHEAD + 1
  times, which spares the register moves of the hand-off. ``DequantConfig.num_stages`` = AHEAD + 1.
* Each word's products are summed without its scale, then scaled once: ``acc[n, word] += scale *
  sum_j q_j x_j`` (a word never straddles two scale groups); ``acc`` is reduced across threads once,
  at the end.
* INT4 unpacking in one instruction a weight, with no shift and no int-to-float conversion: nibble j is masked
  in place (nibbles 6-7 after one shift a word) and its bits read as a float32 whose exponent field is 0 or 1,
  which is exactly ``q * 16^J * 2^-149`` (subnormals are not flushed). The activation it multiplies carries
  ``2^64 * 16^-J`` (once a step for all rows of W), the stored ``q + 8``'s offset is ``-8 * sum_j x_j`` (once a
  word for all rows), and the sum is scaled back by a power of two at the end. Per weight: one LOP3 and one
  FFMA per activation row. FP8: the hardware's e4m3 pair conversion.
* Up to four activation rows share each unpacked tile (``ROWS``: 1 to 4, one accumulator each).

The products are the unrounded dequantized weight times the activation in float32 (INT4: summed as ``sum q x -
8 sum x``, float32-accurate; the tensor-core kernel rounds the dequantized weight to the activation dtype first;
the two agree to that rounding).

A plain float weight (``PLAIN``, the mixture-of-experts slots of tandem/kernels/moe_slots.py only) takes the same
loop without scales: a thread's "word" is 16 bytes of a row (8 bf16/fp16 or 4 fp32 weights, one vector load),
rounded to the activation dtype as the tensor-core kernels round it; K must hold whole words (``plain_word``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.activation import activation_load
from tandem.kernels.dequant_tiles import FP8, INT4, PLAIN
from tandem.kernels.pdl import pdl_enter

INT4_HI_SHIFT = 24  # the kernel's ``hi_shift`` argument (_unpack)
INT4_SHIFT = tl.constexpr(85)  # INT4 products are summed times 2^-85 (149 - 64: _nibble, _row_partial), then scaled back


def plain_word(dtype: torch.dtype) -> int | None:
    """The weights of a plain (float) weight's word: 16 bytes, one vector load per thread and row (the kernel
    computes the same from the weight's dtype); None for a dtype the kernel does not take plain."""
    return 16 // dtype.itemsize if dtype in (torch.bfloat16, torch.float16, torch.float32) else None


def gemv_block_k(fmt: int, s_cols: int, block_k: int) -> int | None:
    """The K step the kernel takes for a requested ``block_k``: whole words (8 INT4 or 4 FP8 weights), and
    whole scale groups or a part of one (so that a step's scales lie at a fixed offset from its first);
    None where a word would straddle two scales. A plain weight has no scales: whole words of up to 8."""
    if fmt == PLAIN:
        return max(block_k, 8)
    per_word = {INT4: 8, FP8: 4}.get(fmt)
    if per_word is None or s_cols % per_word:
        return None
    block_k = max(block_k, per_word)
    if block_k % s_cols and s_cols % block_k:  # a step must hold whole scale groups or lie inside one
        block_k = s_cols & -s_cols  # the largest power of two dividing s_cols
    return block_k


@triton.jit
def _tile_offsets(FORMAT: tl.constexpr, PER_WORD: tl.constexpr, n0, rows, STRIDE_W: tl.constexpr,
                  STRIDE_S: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr, BLOCK_K: tl.constexpr,
                  SCALE_ROW_UNIFORM: tl.constexpr):
    """Offsets of a tile's elements from the program's first row ``n0`` at column 0 (``rows``: the
    tile's rows counted from there): INT4 words ``[words, BLOCK_N]``, FP8 bytes ``[words, BLOCK_N, 4]``
    (PLAIN elements ``[words, BLOCK_N, PER_WORD]``, no scales);
    of each word's scale (``[words, BLOCK_N]`` from n0's, or ``[words, 1]`` where all the program's rows
    share one scale row, or from row 0 where they span several); and each word's first column. Built
    word-major and transposed after loading (free): the compiler then spreads a warp's threads along a
    row's words, one word each, with the tile's rows repeated in every thread (at constant offsets:
    immediates in the loads)."""
    word = tl.arange(0, BLOCK_K // PER_WORD)
    if FORMAT == 1:
        # contiguity hidden from the compiler: one word a thread, not a 16-byte vector of four
        w = rows[None, :] * STRIDE_W + tl.max_contiguous(word, 1)[:, None]
        s = rows[None, :] * STRIDE_S + (word // (S_COLS // 8))[:, None]
    else:
        w = rows[None, :, None] * STRIDE_W + (word[:, None, None] * PER_WORD + tl.arange(0, PER_WORD)[None, None, :])
        if FORMAT == 0:
            s = word[:, None]  # unused: a plain weight has no scales
        elif SCALE_ROW_UNIFORM:
            s = (word * 4 // S_COLS)[:, None]
        else:
            s = ((n0 + rows)[None, :] // S_ROWS) * STRIDE_S + (word * 4 // S_COLS)[:, None]
    return w, s, word * PER_WORD


@triton.jit
def _load_tile(FORMAT: tl.constexpr, w_base, w_offs, s_base, s_offs, first_col, k_begin, k0, live,
               K: tl.constexpr, EVEN_K: tl.constexpr, S_COLS: tl.constexpr, MASKED: tl.constexpr = True):
    """The raw tile of columns ``k_begin + k0 ..`` (``w_base`` points at k_begin) as ``[BLOCK_N, words]``
    (FP8: ``[BLOCK_N, words, 4]``) and its scales ``[BLOCK_N or 1, words]`` (both multiples of BLOCK_K,
    which S_COLS divides or is a multiple of, so that s_offs hold). Nothing is read where ``live`` is
    false (a prefetch past the program's K range) or past K. PLAIN: the tile ``[BLOCK_N, words, PER_WORD]``
    and ones for its scales (multiplying by 1.0 compiles to nothing); whole words lie inside K.
    Not ``MASKED`` (one K range of whole steps: every caller's ``k0`` lies inside K): plain loads, ``live`` unread
    — no predicate to compute and no register to zero first (what that saves: dequant_configs.CLAMPED_STEPS)."""
    if not MASKED:
        if FORMAT == 1:
            w = tl.load(w_base + k0 // 8 + w_offs)
        else:
            w = tl.load(w_base + k0 + w_offs)
        if FORMAT == 0:
            s = tl.full([first_col.shape[0], 1], 1.0, tl.float32)
        else:
            s = tl.load(s_base + (k_begin + k0) // S_COLS + s_offs).to(tl.float32)
        return tl.trans(w, 1, 0) if FORMAT == 1 else tl.trans(w, 1, 0, 2), tl.trans(s)
    if EVEN_K:
        ok = live
    else:
        ok = live & (k0 + first_col < K)[:, None]
    if FORMAT == 1:
        w = tl.load(w_base + k0 // 8 + w_offs, mask=ok, other=0)
    elif EVEN_K:
        w = tl.load(w_base + k0 + w_offs, mask=ok, other=0.0)
    elif FORMAT == 0:  # masked per word: the load stays one vector
        w = tl.load(w_base + k0 + w_offs, mask=ok[:, :, None], other=0.0)
    else:
        w = tl.load(w_base + k0 + w_offs, mask=ok[:, :, None] & (k0 + first_col[:, None, None] + tl.arange(0, 4) < K),
                    other=0.0)
    if FORMAT == 0:
        s = tl.full([first_col.shape[0], 1], 1.0, tl.float32)
    else:
        s = tl.load(s_base + (k_begin + k0) // S_COLS + s_offs, mask=ok, other=0.0).to(tl.float32)
    return tl.trans(w, 1, 0) if FORMAT == 1 else tl.trans(w, 1, 0, 2), tl.trans(s)


@triton.jit
def _halves(t):
    """The even and odd entries of ``t``'s last dim, which each thread holds whole (no data moves)."""
    if len(t.shape) == 2:
        return tl.split(tl.reshape(t, [t.shape[0], t.shape[1] // 2, 2]))
    else:
        return tl.split(tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2] // 2, 2]))


@triton.jit
def _columns(t):
    """The 4 or 8 entries of ``t``'s last dim as a tuple of tensors, in order."""
    even, odd = _halves(t)
    if t.shape[-1] == 4:
        t0, t2 = tl.split(even)
        t1, t3 = tl.split(odd)
        return t0, t1, t2, t3
    else:
        t0, t2, t4, t6 = _columns(even)
        t1, t3, t5, t7 = _columns(odd)
        return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def _nibble(bits, J: tl.constexpr):
    """Nibble ``q`` at bits 4J.. of ``bits`` as the float ``q * 16^J * 2^-149``, for J up to 5: masked in place,
    the bits read as a float32 whose exponent field is 0 or 1, where a float's value is its bits times 2^-149
    (a subnormal or the smallest binade; the kernels compile without flushing subnormals). One LOP3; the
    activation it multiplies carries ``16^-J`` and the sum is scaled back (_row_partial, _store_row)."""
    return (bits & (0xF << (4 * J))).to(tl.float32, bitcast=True)


@triton.jit
def _unpack(FORMAT: tl.constexpr, w, hi_shift, x_dtype: tl.constexpr):
    """The tile's weights without their scales as a tuple of ``[BLOCK_N, words]`` float32 tensors, one
    per position in the word: INT4 the stored nibble ``q + 8`` as ``_nibble`` leaves it (nibbles 0-5 in place,
    6-7 shifted down by ``hi_shift`` = 24: an argument, so that the compiler cannot turn shift and mask into
    two bit-field instructions a nibble), FP8 the e4m3 values, PLAIN the weights rounded to the activation dtype
    ``x_dtype`` (as the tensor-core kernels multiply them; nothing where it is theirs)."""
    if FORMAT == 1:
        hi = (w.to(tl.uint32, bitcast=True) >> hi_shift).to(tl.int32, bitcast=True)
        return (_nibble(w, 0), _nibble(w, 1), _nibble(w, 2), _nibble(w, 3), _nibble(w, 4), _nibble(w, 5),
                _nibble(hi, 0), _nibble(hi, 1))
    elif FORMAT == 2:
        return _columns(w.to(tl.float32))
    else:
        return _columns(w.to(x_dtype).to(tl.float32))


@triton.jit
def _row_partial(FORMAT: tl.constexpr, PER_WORD: tl.constexpr, q, x_row, k0, first_col, row_ok, K: tl.constexpr,
                 SWIGLU: tl.constexpr, MASKED: tl.constexpr = True):
    """``[BLOCK_N, words]``: each word's unscaled weights times the row's activations, summed. A thread's
    activations are one load of a word's columns (``[words, 8 or 4]``), split in registers. ``x_row``
    and ``k0`` count from the program's first column, ``first_col`` from 0. (PLAIN: whole words inside K, masked
    per word: the load stays one vector. ``SWIGLU``: the row is [gate | up], its activations silu(gate) * up.)"""
    j = tl.arange(0, PER_WORD)
    offs = k0 + tl.arange(0, first_col.shape[0])[:, None] * PER_WORD + j[None, :]
    if not MASKED:  # (columns inside K: only the row is checked)
        ok = row_ok
    elif FORMAT == 0:
        ok = row_ok & (k0 + first_col < K)[:, None]
    else:
        ok = row_ok & (k0 + first_col[:, None] + j[None, :] < K)
    xs = _columns(activation_load(x_row + offs, ok, SWIGLU, K))
    if FORMAT == 1:
        # q_j * 16^J * 2^-149 (_nibble) times x_j * 2^64 * 16^-J is q_j * x_j * 2^-INT4_SHIFT, normal for any
        # |x| from 2^-41 up to 2^64; the -8 of every weight is -8 * sum_j x_j, once per word for all rows of W
        offset = xs[0]
        for i in tl.static_range(1, 8):
            offset += xs[i]
        p = q[0] * (xs[0] * 2.0**64)[None, :] + (offset * -(8.0 * 2.0**-INT4_SHIFT))[None, :]
        for i in tl.static_range(1, 8):
            p += q[i] * (xs[i] * (2.0**64 * 0.0625 ** (i % 6)))[None, :]  # (_unpack reads nibble i at 16^(i % 6))
    else:
        p = q[0] * xs[0][None, :]
        for i in tl.static_range(1, PER_WORD):
            p += q[i] * xs[i][None, :]
    return p


@triton.jit
def _store_row(y_ptr, acc, row, M, offs_n, N, stride_ym, bias, FORMAT: tl.constexpr):
    y = tl.sum(acc, axis=1)
    if FORMAT == 1:
        y *= 2.0**INT4_SHIFT  # (exact: a power of two)
    y += bias
    tl.store(y_ptr + row.to(tl.int64) * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=(offs_n < N) & (row < M))


@triton.jit
def _dequant_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ids_ptr, M, N, stride_xm, stride_ym, stride_ys, stride_we, stride_se, hi_shift,
    K: tl.constexpr, K_SPLIT: tl.constexpr, FORMAT: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr,
    STRIDE_W: tl.constexpr, STRIDE_S: tl.constexpr, EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLOTS_PER_ROW: tl.constexpr, PDL: tl.constexpr,
    SWIGLU: tl.constexpr = False, AHEAD: tl.constexpr = 1, IDS_SETTLED: tl.constexpr = False,
    CLAMPED: tl.constexpr = False,
):
    """Rows ``pid_m * ROWS ..`` of x times rows ``pid_n * BLOCK_N ..`` of W over columns
    ``pid_s * K_SPLIT ..`` (float32 partial sums at ``y_ptr + pid_s * stride_ys`` where K is split).
    ``EVEN_N``: BLOCK_N divides N; otherwise the last tile re-reads valid rows (only its store is masked).
    ``SLOTS_PER_ROW`` > 0: mixture-of-experts slots (ROWS 1): output row ``pid_m`` is slot ``pid_m`` of
    ``ids_ptr`` (its expert: W and its scales offset by ``stride_we`` / ``stride_se`` per expert), its
    activation row ``pid_m // SLOTS_PER_ROW`` (the token for gate/up, the slot itself for down); ``IDS_SETTLED``: the
    ids were written before the kernel just before this one (pdl.py: visible before the wait), so the slot's first
    weights are read while that kernel finishes, as a dense weight's are. ``CLAMPED``: see ``MASKED`` below
    (DequantConfig.clamped_read_ahead)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    if SLOTS_PER_ROW > 0:  # the slot's expert comes from the routing kernel: wait for it first if it is the one before
        if not IDS_SETTLED:
            pdl_enter(PDL)
        # (settled, read before the wait: from L2, where the routing kernel's writes are, never a line an earlier
        # layer's launch left in this SM's L1 — the graph's ids buffer is the same address in every layer)
        expert = tl.load(ids_ptr + pid_m, cache_modifier=".cg" if IDS_SETTLED else "").to(tl.int64)
        w_ptr += expert * stride_we
        s_ptr += expert * stride_se
    # a thread's word: 32 bits of INT4 or FP8, 16 bytes of a plain weight (see plain_word)
    PER_WORD: tl.constexpr = (8 if FORMAT == 1 else 4 if FORMAT == 2
                              else 128 // w_ptr.dtype.element_ty.primitive_bitwidth)
    SCALE_ROW_UNIFORM: tl.constexpr = FORMAT == 2 and S_ROWS % BLOCK_N == 0
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    # one K range of whole steps (K not split): every step lies inside K, and a read-ahead past the last step reads
    # the last step again (in L2 by then, never multiplied) instead of a masked load
    MASKED: tl.constexpr = not (CLAMPED and EVEN_K and K_SPLIT == K)
    LAST: tl.constexpr = K - BLOCK_K
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_N) if EVEN_N else tl.minimum(offs_n, N - 1) - n0
    k_begin = pid_s * K_SPLIT
    w_base = w_ptr + n0.to(tl.int64) * STRIDE_W + (k_begin // 8 if FORMAT == 1 else k_begin)
    s_base = s_ptr
    if S_ROWS == 1 or SCALE_ROW_UNIFORM:
        s_base += (n0 // S_ROWS).to(tl.int64) * STRIDE_S
    w_offs, s_offs, first_col = _tile_offsets(FORMAT, PER_WORD, n0, rows, STRIDE_W, STRIDE_S, S_ROWS, S_COLS, BLOCK_K,
                                              SCALE_ROW_UNIFORM)
    first_col += k_begin
    m0 = pid_m * ROWS
    x_m = m0
    if SLOTS_PER_ROW > 0:
        x_m = m0 // SLOTS_PER_ROW
    x_row = x_ptr + x_m.to(tl.int64) * stride_xm + k_begin
    # the first step's weights do not depend on the previous kernel (but for an expert's): read while it finishes
    w, s = _load_tile(FORMAT, w_base, w_offs, s_base, s_offs, first_col, k_begin, 0, k_begin < K, K, EVEN_K,
                      S_COLS, MASKED)
    if AHEAD > 1:  # (AHEAD 3: w2 the third step; each step hands its tile down the line: w <- w1 <- w2 <- load)
        w1, s1 = _load_tile(FORMAT, w_base, w_offs, s_base, s_offs, first_col, k_begin,
                            BLOCK_K if MASKED else min(BLOCK_K, LAST),
                            (BLOCK_K < K_SPLIT) & (k_begin + BLOCK_K < K), K, EVEN_K, S_COLS, MASKED)
    if AHEAD > 2:
        w2, s2 = _load_tile(FORMAT, w_base, w_offs, s_base, s_offs, first_col, k_begin,
                            2 * BLOCK_K if MASKED else min(2 * BLOCK_K, LAST),
                            (2 * BLOCK_K < K_SPLIT) & (k_begin + 2 * BLOCK_K < K), K, EVEN_K, S_COLS, MASKED)
    if SLOTS_PER_ROW == 0 or IDS_SETTLED:
        pdl_enter(PDL)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K // PER_WORD], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for kk in tl.range(0, K_SPLIT, BLOCK_K, loop_unroll_factor=AHEAD + 1):
        ahead = kk + AHEAD * BLOCK_K
        if not MASKED:
            ahead = tl.minimum(ahead, LAST)
        w_next, s_next = _load_tile(FORMAT, w_base, w_offs, s_base, s_offs, first_col, k_begin, ahead,
                                    (ahead < K_SPLIT) & (k_begin + ahead < K), K, EVEN_K, S_COLS, MASKED)
        q = _unpack(FORMAT, w, hi_shift, x_ptr.dtype.element_ty)
        acc0 += s * _row_partial(FORMAT, PER_WORD, q, x_row, kk, first_col, m0 < M, K, SWIGLU, MASKED)
        if ROWS > 1:
            acc1 += s * _row_partial(FORMAT, PER_WORD, q, x_row + stride_xm, kk, first_col, m0 + 1 < M, K, SWIGLU,
                                     MASKED)
        if ROWS > 2:
            acc2 += s * _row_partial(FORMAT, PER_WORD, q, x_row + 2 * stride_xm, kk, first_col, m0 + 2 < M, K, SWIGLU,
                                     MASKED)
        if ROWS > 3:
            acc3 += s * _row_partial(FORMAT, PER_WORD, q, x_row + 3 * stride_xm, kk, first_col, m0 + 3 < M, K, SWIGLU,
                                     MASKED)
        if AHEAD == 1:
            w, s = w_next, s_next
        elif AHEAD == 2:
            w, s, w1, s1 = w1, s1, w_next, s_next
        else:
            w, s, w1, s1, w2, s2 = w1, s1, w2, s2, w_next, s_next
    bias = tl.load(b_ptr + n0 + rows).to(tl.float32) if HAS_BIAS else tl.zeros([BLOCK_N], dtype=tl.float32)
    y_ptr += pid_s.to(tl.int64) * stride_ys
    _store_row(y_ptr, acc0, m0, M, offs_n, N, stride_ym, bias, FORMAT)
    if ROWS > 1:
        _store_row(y_ptr, acc1, m0 + 1, M, offs_n, N, stride_ym, bias, FORMAT)
    if ROWS > 2:
        _store_row(y_ptr, acc2, m0 + 2, M, offs_n, N, stride_ym, bias, FORMAT)
    if ROWS > 3:
        _store_row(y_ptr, acc3, m0 + 3, M, offs_n, N, stride_ym, bias, FORMAT)
