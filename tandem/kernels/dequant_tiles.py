"""Weight tiles dequantized in registers, shared by the quantized linear kernels (dequant_gemm.py) and
the fused MoE kernel (fused_moe.py).

``weight_tile`` returns the ``[BLOCK_K, BLOCK_N]`` tile ``W[offs_n, offs_k]ᵀ``: quantized formats as the
product with the scale in float32, which the caller rounds once to the activation dtype, as the reference
path does (tandem/layers/quantized_linear.py), so the kernels multiply exactly the weights the reference
dequantizes; a plain weight as stored. The formats stay as the checkpoint stores them:

* ``PLAIN`` (0): a float weight ``[N, K]``.
* ``INT4`` (1): compressed-tensors ``pack-quantized``: ``packed [N, K/8]`` int32, eight nibbles low
  first, each ``q + 8``; ``scale [N, K/GROUP]`` float32, bf16 or fp16 (widened as read); ``W = (nibble - 8) * scale``. Each int32 is
  loaded once per nibble it holds: the repeats hit L1, DRAM reads the packed weight once.
* ``FP8`` (2): e4m3 ``w [N, K]`` and float32 ``scale_inv [ceil(N/S_ROWS), ceil(K/S_COLS)]``.

``offs_n`` must already be clamped into ``[0, N)`` (callers mask the store, not the loads); ``k_ok``
masks the K tail, where the tile is zero.
"""

from __future__ import annotations

import triton
import triton.language as tl

PLAIN, INT4, FP8 = 0, 1, 2


def interpreting() -> bool:
    """Under TRITON_INTERPRET the kernels multiply in float32: the interpreter's ``tl.dot`` reads bf16 as
    raw integers."""
    return bool(triton.knobs.runtime.interpret)


@triton.jit
def weight_tile(FORMAT: tl.constexpr, w_ptr, s_ptr, rows_n, k0, K: tl.constexpr, stride_wn, stride_sn,
                S_ROWS: tl.constexpr, S_COLS: tl.constexpr, BLOCK_K: tl.constexpr, WHOLE_GROUPS: tl.constexpr):
    """The tile of rows ``rows_n`` and columns ``k0 .. k0 + BLOCK_K``. ``WHOLE_GROUPS``: BLOCK_K is a
    multiple of the INT4 group or of the FP8 block's columns (both powers of two), or divides the latter;
    then each packed word and each scale is loaded once and expanded in registers, else gathered per
    element."""
    BLOCK_N: tl.constexpr = rows_n.shape[0]
    rows = rows_n.to(tl.int64)[None, :]
    if FORMAT == 1:
        if WHOLE_GROUPS:
            WORDS: tl.constexpr = BLOCK_K // 8
            GROUPS: tl.constexpr = BLOCK_K // S_COLS
            offs_w = k0 // 8 + tl.arange(0, WORDS)
            word = tl.load(w_ptr + rows * stride_wn + offs_w[:, None], mask=(offs_w < (K + 7) // 8)[:, None], other=0)
            shifts = (tl.arange(0, 8) * 4)[None, :, None]
            nibble = tl.reshape((word[:, None, :] >> shifts) & 0xF, [BLOCK_K, BLOCK_N])  # k = word * 8 + j
            offs_g = k0 // S_COLS + tl.arange(0, GROUPS)
            scale = tl.load(s_ptr + rows * stride_sn + offs_g[:, None],
                            mask=(offs_g < (K + S_COLS - 1) // S_COLS)[:, None], other=0.0)
            scale = tl.reshape(tl.broadcast_to(scale[:, None, :], [GROUPS, S_COLS, BLOCK_N]), [BLOCK_K, BLOCK_N])
        else:
            ks = (k0 + tl.arange(0, BLOCK_K))[:, None]
            mask = ks < K
            word = tl.load(w_ptr + rows * stride_wn + ks // 8, mask=mask, other=0)
            nibble = (word >> ((ks % 8) * 4)) & 0xF
            scale = tl.load(s_ptr + rows * stride_sn + ks // S_COLS, mask=mask, other=0.0)
        tile = (nibble - 8).to(tl.float32) * scale.to(tl.float32)  # (scales held as the checkpoint stores them)
    elif FORMAT == 2:
        ks = (k0 + tl.arange(0, BLOCK_K))[:, None]
        w = tl.load(w_ptr + rows * stride_wn + ks, mask=ks < K, other=0.0)
        scale_rows = (rows_n // S_ROWS).to(tl.int64)[None, :] * stride_sn
        if WHOLE_GROUPS:
            if S_COLS >= BLOCK_K:
                # [1, BLOCK_N]: one block column per step (none past K, where a K split's last steps may fall)
                scale = tl.load(s_ptr + scale_rows + k0 // S_COLS, mask=k0 < K, other=0.0)
            else:
                BLOCKS: tl.constexpr = BLOCK_K // S_COLS
                offs_b = k0 // S_COLS + tl.arange(0, BLOCKS)
                scale = tl.load(s_ptr + scale_rows + offs_b[:, None],
                                mask=(offs_b < (K + S_COLS - 1) // S_COLS)[:, None], other=0.0)
                scale = tl.reshape(tl.broadcast_to(scale[:, None, :], [BLOCKS, S_COLS, BLOCK_N]), [BLOCK_K, BLOCK_N])
        else:
            scale = tl.load(s_ptr + scale_rows + ks // S_COLS, mask=ks < K, other=0.0)
        tile = w.to(tl.float32) * scale.to(tl.float32)
    else:
        ks = (k0 + tl.arange(0, BLOCK_K))[:, None]
        tile = tl.load(w_ptr + rows * stride_wn + ks, mask=ks < K, other=0.0)
    return tile


def whole_groups(fmt: int, s_cols: int, block_k: int) -> bool:
    """Whether ``weight_tile`` may expand whole groups/blocks for this BLOCK_K (see its docstring)."""
    power_of_two = s_cols & (s_cols - 1) == 0
    if fmt == INT4:
        return power_of_two and block_k % s_cols == 0
    if fmt == FP8:
        return s_cols % block_k == 0 or (power_of_two and block_k % s_cols == 0)
    return False
