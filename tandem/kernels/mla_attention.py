"""Paged multi-head latent attention (MLA) in the absorbed form, in one Triton kernel.

Every head attends to one shared latent cache entry per token (MQA with key width ``kv_lora + rope``
and value ``c_kv``, width ``kv_lora``; ../shared/reference/deepseek_v3_kimi.md §2): a program owns
(sequence, block of heads, query tile[, split]) and holds ``BLOCK_H`` heads times ``BLOCK_Q`` new
tokens as its rows, so each latent tile is read from memory once for all of them. The pool is
``[num_pages, page_size, (1,) kv_lora + rope]``: ``c_kv`` then the rotated ``k_pe``, as
tandem.attention.mla_torch_backend stores it. Scores are ``q_latent · c + q_rope · k_pe``; softmax is
online, in float32, in base 2 (scale folded with log2 e); the output is ``Σ p c`` (before ``W_UV``).

Sequences may have different numbers of new tokens (packed, ``cu_q_lens``); the grid is sized by the
largest (``max_q_len``, a host number), and tiles past a sequence's own tokens do nothing.

Visibility follows tandem/kernels/paged_attention.py per sequence: with ``mask_widths[b] == W > 0``,
keys before the last ``W`` are always seen and new token ``i`` sees the last ``W`` as
``mask[b, i, :W]`` says (``W <= 64``, packed once per program into a word of bits per row); with
``W == 0`` new token ``i`` sees keys up to its own (causal; decode sees everything).

Split-K ("flash-decoding"): with ``num_splits > 1`` each sequence's keys are cut into that many
chunks whose partial outputs and log-sum-exps are merged by paged_attention's merge kernel in a fixed
order, so results do not depend on timing — or, with ``merge=False``, handed back unmerged (``LatentSplits``)
for the kernel after it to merge as it reads them (tandem/kernels/mla_absorb.py's ``absorb_out``: one dependent
kernel a layer fewer). The split count is a launch constant (graph-safe).
Rows that see no key produce zeros, never NaN; keys past ``kv_len`` are never loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels.paged_attention import _NO_KEY, _split_bounds, _store_result, default_num_splits, merge_splits
from tandem.kernels.pdl import pdl_enter, pdl_launch


@dataclass(frozen=True)
class LatentSplits:
    """The latent attention's output before its splits are merged: ``part_o`` [S, T, H, kv_lora] float32 partial
    outputs and ``part_lse`` [S, T, H] their log-sum-exps (base 2; a split that saw no key has ``_NO_KEY`` and wrote
    nothing); ``dtype``: what the merged output is rounded to, as the merge kernel rounds it."""

    part_o: torch.Tensor
    part_lse: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.part_o.shape[1:])


@triton.jit
def _latent_tile(q_lat, q_pe, n0, end, m_i, l_i, acc, bt_row, pool_ptr, row_limit, row_bits, tail_start,
                 scale_log2, stride_pool_page, stride_pool_slot,
                 LORA: tl.constexpr, ROPE: tl.constexpr, ROPE_BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASK_W: tl.constexpr, IEEE_DOT: tl.constexpr):
    """One BLOCK_N-key step of online softmax over the latent entries: c_kv is both key part and value."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < end
    d = tl.arange(0, LORA)
    r = tl.arange(0, ROPE_BLOCK)
    page = tl.load(bt_row + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)  # int64: huge pools
    entry = tl.multiple_of(page * stride_pool_page + (n % PAGE_SIZE) * stride_pool_slot, 8)
    c = tl.load(pool_ptr + entry[:, None] + d[None, :], mask=n_ok[:, None], other=0.0).to(q_lat.dtype)
    pe = tl.load(pool_ptr + LORA + entry[:, None] + r[None, :], mask=n_ok[:, None] & (r < ROPE)[None, :],
                 other=0.0).to(q_lat.dtype)
    if IEEE_DOT:  # float32 inputs: no tf32 rounding, so float32 results match the reference to ~1e-6
        s = tl.dot(q_lat, tl.trans(c), input_precision="ieee") + tl.dot(q_pe, tl.trans(pe), input_precision="ieee")
    else:
        s = tl.dot(q_lat, tl.trans(c)) + tl.dot(q_pe, tl.trans(pe))
    s = s * scale_log2
    visible = n[None, :] <= row_limit[:, None]
    if MASK_W > 0:
        j = n - tail_start
        shift = tl.where(j >= 0, j, 0).to(row_bits.dtype)
        visible = visible & ((j < 0)[None, :] | (((row_bits[:, None] >> shift[None, :]) & 1) != 0))
    visible = visible & n_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE_DOT:
        pv = tl.dot(p.to(q_lat.dtype), c, input_precision="ieee")
    else:
        pv = tl.dot(p.to(q_lat.dtype), c)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _mla_attention_kernel(
    q_lat_ptr, q_pe_ptr, pool_ptr, out_ptr, bt_ptr, kv_lens_ptr, cu_q_ptr, mask_ptr, widths_ptr,
    part_o_ptr, part_lse_ptr,
    num_heads, scale_log2,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_ot, stride_oh, stride_pool_page, stride_pool_slot,
    stride_bt, stride_mb, stride_mi, stride_mj,
    stride_ps, stride_part_t, stride_ph, stride_ls, stride_lt,
    LORA: tl.constexpr, ROPE: tl.constexpr, ROPE_BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_W: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE_DOT: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    q_tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + b)
    # Row r of the tile is head head_block*BLOCK_H + r%BLOCK_H of new token q_tile*BLOCK_Q + r//BLOCK_H.
    rows = tl.arange(0, BLOCK_M)
    qi = q_tile * BLOCK_Q + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_ok = (rows < BLOCK_H * BLOCK_Q) & (qi < q_len) & (head < num_heads)
    tok = (q_start + qi).to(tl.int64)
    d = tl.arange(0, LORA)
    r = tl.arange(0, ROPE_BLOCK)
    q_lat = tl.load(q_lat_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_pe_ptr + tok[:, None] * stride_rt + head[:, None] * stride_rh + r[None, :],
                   mask=row_ok[:, None] & (r < ROPE)[None, :], other=0.0)
    if INTERPRET:  # the interpreter's tl.dot mishandles bf16 (stored as raw uint16)
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    causal_limit = kv_len - q_len + qi  # new token i sees keys up to its own
    # Keys after the tile's last token are invisible to the whole causal tile.
    stop = tl.minimum(kv_len, kv_len - q_len + (q_tile + 1) * BLOCK_Q)
    if MASK_W > 0:
        width = tl.load(widths_ptr + b)
        tail_start = kv_len - width  # first key the mask talks about (kv_len: no mask, nothing in the tail)
        bits_ty: tl.constexpr = tl.int32 if MASK_W <= 32 else tl.int64
        row_bits = tl.zeros([BLOCK_M], dtype=bits_ty)
        for j in tl.static_range(MASK_W):
            seen = tl.load(mask_ptr + b * stride_mb + qi * stride_mi + j * stride_mj, mask=row_ok & (j < width),
                           other=0)
            row_bits = row_bits | ((seen != 0).to(bits_ty) << j)
        row_limit = tl.where(width > 0, kv_len - 1, causal_limit)
        stop = tl.where(width > 0, kv_len, stop)
    else:
        tail_start = kv_len
        row_bits = tl.zeros([BLOCK_M], dtype=tl.int32)
        row_limit = causal_limit
    stop = tl.where(q_tile * BLOCK_Q < q_len, stop, 0)  # a tile past this sequence's tokens reads nothing

    start, end = _split_bounds(stop, split, NUM_SPLITS, BLOCK_N)

    m_i = tl.full([BLOCK_M], _NO_KEY, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, LORA], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt
    if INTERPRET:
        # The interpreter (numpy >= 2) cannot use a loaded scalar as a range() bound (see paged_attention).
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _latent_tile(q_lat, q_pe, n0, end, m_i, l_i, acc, bt_row, pool_ptr, row_limit, row_bits,
                                         tail_start, scale_log2, stride_pool_page, stride_pool_slot,
                                         LORA, ROPE, ROPE_BLOCK, PAGE_SIZE, BLOCK_N, MASK_W, IEEE_DOT)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _latent_tile(q_lat, q_pe, n0, end, m_i, l_i, acc, bt_row, pool_ptr, row_limit, row_bits,
                                         tail_start, scale_log2, stride_pool_page, stride_pool_slot,
                                         LORA, ROPE, ROPE_BLOCK, PAGE_SIZE, BLOCK_N, MASK_W, IEEE_DOT)

    _store_result(acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, split, tok, head, d, row_ok,
                  stride_ot, stride_oh, stride_ps, stride_part_t, stride_ph, stride_ls, stride_lt, NUM_SPLITS)


# A latent key is 576 wide and serves every head of the block: splits pay from ~32 keys each. Measured on the
# H200 at batch 1 (bench --sections mla): 32 splits 2-6x faster than the 2-16 of the dense kernels' 512-key rule.
MLA_MIN_SPLIT_KEYS = 32


@dataclass(frozen=True)
class LatentTiles:
    """Launch tiles: ``rows`` (heads x new tokens a program holds; bounded by the float32 accumulator,
    rows x kv_lora, that must stay in registers), keys per step, warps (None: 4 for accumulators up to
    16 x 512, else 8), pipeline stages."""

    rows: int
    block_n: int
    num_warps: int | None = None
    num_stages: int = 2


def default_tiles(kv_lora_rank: int) -> LatentTiles:
    if kv_lora_rank >= 256:  # Kimi's 512: 16-32 rows (compile_check shows no spills)
        return LatentTiles(rows=32, block_n=32)
    return LatentTiles(rows=64, block_n=64)


def tile_shape(num_heads: int, max_q_len: int, tiles: LatentTiles) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_Q, BLOCK_M): a program's heads, new tokens, and rows (>= 16 for tl.dot)."""
    block_h = min(triton.next_power_of_2(num_heads), tiles.rows)
    block_q = min(triton.next_power_of_2(max_q_len), max(1, tiles.rows // block_h))
    return block_h, block_q, max(16, block_h * block_q)


def mla_paged_attention(
    q_latent: torch.Tensor,  # [T, H, kv_lora]: q_nope folded with W_UK
    q_rope: torch.Tensor,  # [T, H, rope], rotated
    pool: torch.Tensor,  # [num_pages, page_size, (1,) kv_lora + rope]
    block_tables: torch.Tensor,  # int32 [B, max_pages]
    kv_lens: torch.Tensor,  # int32 [B]: cached + new entries, the new ones already in the pool
    cu_q_lens: torch.Tensor,  # int32 [B + 1]: sequence b owns tokens cu_q_lens[b] .. cu_q_lens[b + 1] - 1
    max_q_len: int,  # at least every sequence's new tokens (sizes the grid)
    scale: float,
    mask: torch.Tensor | None = None,  # bool/uint8 [B, >= max_q_len, MASK_W <= 64]: sequence b's tree in [:, :, :W_b]
    mask_widths: torch.Tensor | None = None,  # int32 [B]: W_b, 0 for a causal sequence
    out: torch.Tensor | None = None,  # [T, H, kv_lora]; allocated in q_latent's dtype when None
    num_splits: int | None = None,  # power of two; None: from the shapes
    tiles: LatentTiles | None = None,  # None: default_tiles (benchmarks try others)
    merge: bool = True,  # False: with several splits, return them unmerged (LatentSplits)
) -> "torch.Tensor | LatentSplits":
    num_tokens, num_heads, lora = q_latent.shape
    rope = q_rope.shape[-1]
    batch = kv_lens.shape[0]
    page_size = pool.shape[1]
    if out is None:
        out = torch.empty((num_tokens, num_heads, lora), dtype=q_latent.dtype, device=q_latent.device)
    if batch == 0 or num_tokens == 0:
        return out
    if lora < 16 or lora & (lora - 1) or pool.shape[-1] != lora + rope or q_rope.shape[:2] != (num_tokens, num_heads):
        raise ValueError(f"kv_lora {lora} must be a power of two >= 16 with pool width kv_lora + rope; got "
                         f"q_latent {tuple(q_latent.shape)}, q_rope {tuple(q_rope.shape)}, pool {tuple(pool.shape)}")
    if pool.dim() == 4 and pool.shape[2] != 1:
        raise ValueError(f"the latent pool has one entry per token, got {tuple(pool.shape)}")
    if any(t.stride(-1) != 1 for t in (q_latent, q_rope, out, pool)):
        raise ValueError("q_latent, q_rope, out and the pool need a contiguous last dimension")
    if pool.stride(0) % 8 or pool.stride(1) % 8:  # the kernel promises 16-byte aligned entries
        raise ValueError(f"pool strides {pool.stride()[:2]} must be multiples of 8 elements")
    tiles = tiles or default_tiles(lora)
    block_h, block_q, block_m = tile_shape(num_heads, max_q_len, tiles)
    num_warps = tiles.num_warps or (4 if block_m * lora <= 16 * 512 else 8)
    head_blocks = -(-num_heads // block_h)
    q_tiles = -(-max_q_len // block_q)
    if num_splits is None:
        num_splits = default_num_splits(batch, head_blocks * q_tiles, block_tables.shape[1] * page_size,
                                        q_latent.device, MLA_MIN_SPLIT_KEYS)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if mask is not None:
        mask_w = mask.shape[2]
        if mask_widths is None or mask.shape[0] != batch or mask.shape[1] < max_q_len or not 1 <= mask_w <= 64:
            raise ValueError(f"mask {tuple(mask.shape)} with widths does not fit batch {batch}, max_q_len {max_q_len}")
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)  # no copy: Triton reads bytes
        mask_strides = mask.stride()
    else:
        mask_w, mask_strides = 0, (0, 0, 0)
        mask = mask_widths = kv_lens  # never read; any pointer will do

    if num_splits > 1:
        part_o = torch.empty((num_splits, num_tokens, num_heads, lora), dtype=torch.float32, device=out.device)
        part_lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=out.device)
        part_strides = (*part_o.stride()[:3], *part_lse.stride()[:2])
    else:
        part_o = part_lse = out  # never touched
        part_strides = (0, 0, 0, 0, 0)
    pdl = pdl_launch(q_latent)
    _mla_attention_kernel[(batch, head_blocks, q_tiles * num_splits)](
        q_latent, q_rope, pool, out, block_tables, kv_lens, cu_q_lens, mask, mask_widths, part_o, part_lse,
        num_heads, scale * 1.4426950408889634,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1),
        pool.stride(0), pool.stride(1), block_tables.stride(0), *mask_strides, *part_strides,
        LORA=lora, ROPE=rope, ROPE_BLOCK=max(16, triton.next_power_of_2(rope)), PAGE_SIZE=page_size,
        BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=tiles.block_n,
        MASK_W=mask_w, NUM_SPLITS=num_splits, IEEE_DOT=q_latent.dtype == torch.float32,
        INTERPRET=bool(triton.knobs.runtime.interpret),
        num_warps=num_warps, num_stages=tiles.num_stages, **pdl,
    )
    if num_splits > 1:
        if not merge:
            return LatentSplits(part_o, part_lse, out.dtype)
        merge_splits(part_o, part_lse, out, pdl)
    return out
