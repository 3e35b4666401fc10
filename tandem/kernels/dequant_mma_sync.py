"""W4A16 for 4-8 activation rows (decode of a few requests, a chain's verify) on the tensor cores: the INT4 weight
words feed ``mma.sync``'s A operand from registers. Launched by tandem/kernels/dequant_gemm.py's ``_launch`` for
``DequantConfig(kernel="mma_sync")``, its default at 4-8 INT4 rows.

Why: the CUDA-core GEMV (tandem/kernels/dequant_gemv.py) pays a multiply-add per weight and row; the wgmma kernel
(tandem/kernels/dequant_mma.py) stages the unpacked bf16 tile through shared memory (~7 instructions a weight in its
SASS). Here ~2.0 a weight in the SASS of the 8B down shape (compiled for sm_90 on a CPU: compile_check), 0.875 of
them the unpack, whatever the rows. Measured on an H100 (INT4 8B engine, bench --sections quant_engines): batch-8
decode 1981 tok/s, against 1635 with the words loaded 4 bytes at a time where mma wants them (same call) and 1002
with the wgmma kernel (an earlier call); a chain's 4-row verify at τ 4 800 against 693 tok/s with the GEMV. At one
row it stays slower than the GEMV (8B down 26.2 against 17.1 us), which keeps 1-3 rows.

How (Gluon, Triton's layout-explicit dialect, so that no layout conversion moves data but the quad's transpose —
every other ``convert_layout`` here is asserted trivial at compile time):

* The checkpoint's own packing (compressed-tensors ``pack-quantized``: word w of a row holds columns 8w .. 8w+7,
  nibble i = column 8w + i, as q + 8) is used as it is: a thread with lane l holds word ``l % 4`` of each
  32-column group, for rows ``l / 4`` and ``l / 4 + 8`` of its warp's 16 — exactly the rows and the four K pairs
  of mma.m16n8k16's A fragment, once the dot's K order is permuted: logical column ``8t + 2j + h`` of a group is
  checkpoint column ``8j + t + 4h``. (A quad loads a step's 16 words of a row as 16-byte loads, one group each,
  and transposes them through shared memory: ``_step``.) LOP3 with 0x000F000F under bf16's 128 makes nibbles t and
  t + 4 the pair ``(128 + q_t, 128 + q_{t+4})`` in one register — one A register, exact.
* The activations take the same order: the 8 columns a thread needs are 8 consecutive ones (a 16-byte load),
  paired (x_t, x_{t+4}) by PRMT.
* ``128 + q`` instead of ``q - 8``: the products are summed and the ``-136 * sum(x)`` of each group comes from one
  more mma with a constant A (shared by every row tile), so the unpack needs no HFMA2.
* Float32 accumulation; each group's partial product is scaled in float32 (the scale never rounds to bf16).
* Rows of x padded to 8 (mma's N); K split over programs like the GEMV's, partial sums summed by the caller.
* The first step's words and scales are loaded before the PDL wait (tandem/kernels/pdl.py: weights do not depend on
  the previous kernel); x, written by the previous kernel, after it.

Gluon kernels do not run under the Triton interpreter: the CPU tests compile this one (compile_check) and the GPU
tests run it against the dequantized weights.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from tandem.kernels.dequant_configs import MMA_SYNC_GROUP, MMA_SYNC_ROWS, MMA_SYNC_STEP
from tandem.kernels.dequant_tiles import interpreting

GROUP = gl.constexpr(MMA_SYNC_GROUP)  # the only group size this kernel takes: one A fragment's K span, four words
ROWS = gl.constexpr(MMA_SYNC_ROWS)  # activation rows a program (mma's N)
TILE_ROWS = 64  # weight rows per repeat: 4 warps x mma's 16


def _unpack_asm() -> str:
    """PTX for one word ($4; $5 is the same word, the pack's second element) → four registers ($0-$3), register t
    holding (128 + nibble t, 128 + nibble t + 4) as bf16 — exact, the format's spacing at 128 is 1."""
    shifts = "".join(f"shr.u32 s{t}, $4, {4 * t};\n" for t in (1, 2, 3))
    pairs = "".join(f"lop3.b32 ${t}, {'$4' if t == 0 else f's{t}'}, 0x000F000F, 0x43004300, 0xea;\n" for t in range(4))
    return "{\n.reg .b32 s1, s2, s3;\n" + shifts + pairs + "}"


UNPACK = gl.constexpr(_unpack_asm())


@gluon.jit
def _pdl_enter(PDL: gl.constexpr):
    """tandem/kernels/pdl.py's ``pdl_enter`` (Gluon has no ``tl.extra.cuda.gdc_*``; the same PTX): wait for the
    previous grid (its writes visible), then let the next grid be scheduled."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _a_tile(words, A_L: gl.constexpr):
    """``words [BLOCK_N, 4]`` (word j of a group per row) → the group's A tile ``[BLOCK_N, 32]`` bf16 of 128 + q in
    the dot's K order (logical column 8t + 2j + h = checkpoint column 8j + t + 4h)."""
    pair = gl.join(words, words)  # [N, j, h]: the asm's pack of two elements is one register's two halves
    t = gl.inline_asm_elementwise(UNPACK, "=r,=r,=r,=r,r,r", [pair], dtype=(gl.int16,) * 4, is_pure=True, pack=2)
    tile = gl.join(gl.join(t[0], t[1]), gl.join(t[2], t[3]))  # [N, j, h, t bit 0, t bit 1]
    tile = gl.reshape(gl.permute(tile, (0, 4, 3, 1, 2)), (words.shape[0], 32)).to(gl.bfloat16, bitcast=True)
    return gl.convert_layout(tile, A_L, assert_trivial=True)


@gluon.jit
def _b_tile(x8, B_L: gl.constexpr):
    """``x8 [8 rows, 4 (j), 8 (e)]``, column 8j + e of the group → the B tile ``[32, 8]`` in the dot's K order
    (e = t + 4h)."""
    x = gl.permute(gl.reshape(x8, (8, 4, 2, 4)), (3, 1, 2, 0))  # (t, j, h, row)
    return gl.convert_layout(gl.reshape(x, (32, 8)), B_L, assert_trivial=True)


@gluon.jit
def _scale_of(scales, g: gl.constexpr):
    """Column g (0-3) of ``scales [BLOCK_N, 4]`` held in registers (split: no data moves). Reshaped to (a, b),
    column 2a + b; split takes the last dimension: b first, then a."""
    even, odd = gl.split(gl.reshape(scales, (scales.shape[0], 2, 2)))
    lo, hi = gl.split(even if g % 2 == 0 else odd)
    return lo if g // 2 == 0 else hi


@gluon.jit
def _step(w_ptrs, w_cols, s_ptrs, s_cols, k, K: gl.constexpr, EVEN_K: gl.constexpr, W_L: gl.constexpr,
          WT_L: gl.constexpr):
    """The words (a tuple of 4 ``[BLOCK_N, 4]`` in W_L: word j of each group, lane j of a quad) and scales
    ``[BLOCK_N, 4]`` of the 4 groups from column k. A quad loads its rows' 16 words as four 16-byte loads, lane q the
    4 words of group q; the transpose that gives lane j word j of every group goes through shared memory (a
    quad's lanes reading each other's 16 bytes: 4-byte loads of the words where they belong left the one-row
    kernel ~30 % slower in the engine's decode at 4 and 8 rows, H100). Where K is a multiple of 128 a step past K
    (a prefetch past the end, a split's tail) reads the last step again; otherwise nothing past K is read.
    Either way x is masked to zero there."""
    if EVEN_K:
        k = gl.minimum(k, K - 4 * GROUP)
        scales = gl.load(s_ptrs + k // GROUP).to(gl.float32)  # (held as the checkpoint stores them)
        w16 = gl.load(w_ptrs + k // 8)
    else:
        scales = gl.load(s_ptrs + k // GROUP, mask=k + s_cols * GROUP < K, other=0.0).to(gl.float32)
        w16 = gl.load(w_ptrs + k // 8, mask=k // 8 + w_cols < (K + 7) // 8, other=0)
    w16 = gl.convert_layout(w16, WT_L)  # [N, 16 = group x j]
    w16 = gl.permute(gl.reshape(w16, (w16.shape[0], 4, 4)), (0, 2, 1))  # [N, j, group]
    even, odd = gl.split(gl.reshape(w16, (w16.shape[0], 4, 2, 2)))  # group 2a + b: b split first
    g0, g2 = gl.split(even)
    g1, g3 = gl.split(odd)
    words = (gl.convert_layout(g0, W_L, assert_trivial=True), gl.convert_layout(g1, W_L, assert_trivial=True),
             gl.convert_layout(g2, W_L, assert_trivial=True), gl.convert_layout(g3, W_L, assert_trivial=True))
    return words, scales


@gluon.jit
def _products(acc, words, scales, x_ptrs, x_rows_ok, xc, bias, zero, k, K: gl.constexpr, EVEN_K: gl.constexpr,
              A_L: gl.constexpr, B_L: gl.constexpr, MMA: gl.constexpr):
    """``acc`` plus the step's 4 groups from column k: per group, x's B tile, (128 + q) x and -136 x on the tensor
    cores, scaled in float32."""
    for g in gl.static_range(4):
        kg = k + g * GROUP
        if EVEN_K:  # whole groups: a group is in K or past it
            xg = gl.load(x_ptrs + kg, mask=x_rows_ok & (kg < K), other=0.0)
        else:
            xg = gl.load(x_ptrs + kg, mask=x_rows_ok & (kg + xc < K), other=0.0)
        b = _b_tile(xg, B_L)
        part = mma_v2(_a_tile(words[g], A_L), b, zero) + mma_v2(bias, b, zero)
        acc += part * gl.convert_layout(_scale_of(scales, g), gl.SliceLayout(1, MMA), assert_trivial=True)[:, None]
    return acc


@gluon.jit
def _dequant_mma_sync_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_ym, stride_ys,
    K: gl.constexpr, K_SPLIT: gl.constexpr, STRIDE_W: gl.constexpr, STRIDE_S: gl.constexpr, HAS_BIAS: gl.constexpr,
    BLOCK_N: gl.constexpr, EVEN_N: gl.constexpr, W_L: gl.constexpr, WQ_L: gl.constexpr, WT_L: gl.constexpr,
    S_L: gl.constexpr, X_L: gl.constexpr, PDL: gl.constexpr,
):
    """Rows ``pid_m * 8 ..`` of x times rows ``pid_n * BLOCK_N ..`` of W over columns ``pid_s * K_SPLIT ..``
    (K_SPLIT a multiple of 128: 4 groups a step, the next step's words loaded before this one's products)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B_L: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    EVEN_K: gl.constexpr = K % (4 * GROUP) == 0
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_s = gl.program_id(2)
    k_begin = pid_s * K_SPLIT
    rows_w = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WQ_L))
    rows_s = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S_L))
    if not EVEN_N:  # the last tile re-reads valid rows (only its store is masked)
        rows_w = gl.minimum(rows_w, N - 1)
        rows_s = gl.minimum(rows_s, N - 1)
    w_cols = gl.arange(0, 16, layout=gl.SliceLayout(0, WQ_L))[None, :]
    w_ptrs = w_ptr + rows_w.to(gl.int64)[:, None] * STRIDE_W + w_cols
    s_cols = gl.arange(0, 4, layout=gl.SliceLayout(0, S_L))[None, :]
    s_ptrs = s_ptr + rows_s.to(gl.int64)[:, None] * STRIDE_S + s_cols
    xr = pid_m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, X_L)))
    xc = (gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, X_L))) * 8)[None, :, None] \
        + gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, X_L)))[None, None, :]
    x_ptrs = x_ptr + xr.to(gl.int64)[:, None, None] * stride_xm + xc
    x_rows_ok = (xr < M)[:, None, None]
    zero = gl.zeros([BLOCK_N, ROWS], gl.float32, MMA)
    bias = gl.full([BLOCK_N, 4 * 8], -136.0, gl.bfloat16, A_L)  # -(128 + 8): the unpack's offset and the format's
    acc = gl.zeros([BLOCK_N, ROWS], gl.float32, MMA)
    words, scales = _step(w_ptrs, w_cols, s_ptrs, s_cols, k_begin, K, EVEN_K, W_L, WT_L)
    _pdl_enter(PDL)  # after the first step's weights (no kernel before writes them), before x
    if K_SPLIT % (8 * GROUP) == 0:  # two steps an iteration: the prefetched registers alternate without moves
        for kk in range(0, K_SPLIT, 8 * GROUP):
            k = k_begin + kk
            words_next, scales_next = _step(w_ptrs, w_cols, s_ptrs, s_cols, k + 4 * GROUP, K, EVEN_K, W_L, WT_L)
            acc = _products(acc, words, scales, x_ptrs, x_rows_ok, xc, bias, zero, k, K, EVEN_K, A_L, B_L, MMA)
            words, scales = _step(w_ptrs, w_cols, s_ptrs, s_cols, k + 8 * GROUP, K, EVEN_K, W_L, WT_L)
            acc = _products(acc, words_next, scales_next, x_ptrs, x_rows_ok, xc, bias, zero, k + 4 * GROUP, K, EVEN_K,
                            A_L, B_L, MMA)
    else:
        for kk in range(0, K_SPLIT, 4 * GROUP):
            k = k_begin + kk
            words_next, scales_next = _step(w_ptrs, w_cols, s_ptrs, s_cols, k + 4 * GROUP, K, EVEN_K, W_L, WT_L)
            acc = _products(acc, words, scales, x_ptrs, x_rows_ok, xc, bias, zero, k, K, EVEN_K, A_L, B_L, MMA)
            words = words_next
            scales = scales_next
    rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    cols = pid_m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(0, MMA))
    if HAS_BIAS:
        acc += gl.load(b_ptr + gl.minimum(rows, N - 1)).to(gl.float32)[:, None]
    y_ptrs = y_ptr + pid_s.to(gl.int64) * stride_ys + cols.to(gl.int64)[None, :] * stride_ym + rows[:, None]
    gl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(cols < M)[None, :] & (rows < N)[:, None])


def _layouts(block_n: int):
    """The words' (as mma wants them, as a quad loads them, transposed), scales' and activations' register layouts
    for ``block_n`` rows of W (64 or 128): row bits 0-2 on lanes 2-4, bit 3 in a register, bits 4-5 on the warps,
    higher bits in registers — mma's A rows."""
    repeats = [[64 << i, 0] for i in range((block_n // TILE_ROWS).bit_length() - 1)]
    lanes = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
    warps = [[16, 0], [32, 0]]
    words = gl.DistributedLinearLayout([[8, 0]] + repeats, lanes, warps, [], [block_n, 4])
    scales = gl.DistributedLinearLayout([[0, 1], [0, 2], [8, 0]] + repeats, [[0, 0], [0, 0]] + lanes[2:], warps, [],
                                        [block_n, 4])
    x = gl.DistributedLinearLayout([[0, 0, 1], [0, 0, 2], [0, 0, 4]],
                                   [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]], [[0, 0, 0], [0, 0, 0]], [],
                                   [ROWS.value, 4, 8])
    quad = gl.DistributedLinearLayout([[0, 1], [0, 2], [8, 0]] + repeats, [[0, 4], [0, 8]] + lanes[2:], warps, [],
                                      [block_n, 16])  # a lane's 4 words of one group: 16 bytes
    quad_t = gl.DistributedLinearLayout([[0, 4], [0, 8], [8, 0]] + repeats, lanes, warps, [], [block_n, 16])
    return words, quad, quad_t, scales, x


def check(block_n: int, block_k: int, num_warps: int, group: int, dtype: torch.dtype, k: int) -> None:
    """Raise ValueError where this kernel cannot take the tile or the format."""
    if k < 1:
        raise ValueError("the mma_sync kernel takes K >= 1")
    if block_n not in (64, 128) or block_k % MMA_SYNC_STEP or num_warps != 4:  # (256 spills)
        raise ValueError(f"the mma_sync kernel takes 64 or 128 rows of W, 4 warps and steps of 128 columns; "
                         f"got {block_n} rows, {block_k} columns, {num_warps} warps")
    if interpreting():
        raise ValueError("the mma_sync kernel needs a GPU: Gluon kernels do not run under the Triton interpreter")
    if group != GROUP.value or dtype != torch.bfloat16:
        raise ValueError(f"the mma_sync kernel takes INT4 groups of {GROUP.value} columns and bf16 activations; got "
                         f"groups of {group}, {dtype}")


def launch(x2, w, s, b, target, m, n, k, split, k_split, stride_ys, block_n, has_bias, pdl):
    """One launch over ``(n / block_n, m / 8, split)`` programs (``target`` [split, m, n] float32 where split > 1;
    a split starting past K writes zeros). ``pdl``: the caller's ``pdl_launch``, shared with its split sum."""
    words, quad, quad_t, scales, xl = _layouts(block_n)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, ROWS.value), split)
    _dequant_mma_sync_kernel[grid](
        x2, w, s, b, target, m, n, x2.stride(0), target.stride(-2), stride_ys, K=k, K_SPLIT=k_split,
        STRIDE_W=w.stride(0), STRIDE_S=s.stride(0), HAS_BIAS=has_bias, BLOCK_N=block_n, EVEN_N=n % block_n == 0,
        W_L=words, WQ_L=quad, WT_L=quad_t, S_L=scales, X_L=xl, num_warps=4, **pdl)
