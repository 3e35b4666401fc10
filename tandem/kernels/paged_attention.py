"""Paged attention for decode, tree verification and fixed-width extension, in one Triton kernel.

Every sequence of the batch has the same number ``q_len`` of new tokens (a CUDA graph has a fixed
width), already written to the paged pool, as the last ``q_len`` of its ``kv_len`` keys. One program
owns (sequence, kv head, query tile[, split]) and holds all ``group * q_tile`` query rows that share
that kv head, so each K/V page is read from memory once per kv head instead of once per query head
(GQA packing, as FlashInfer does). Softmax is online, in float32, in base 2 (scale folded with
log2 e).

Visibility: keys before the last ``W`` are always seen; among the last ``W`` the row of new token
``i`` follows ``mask[b, i, :]`` (``W = mask.shape[2]``, ``q_len <= W <= 64``, read once per program
into a 32- or 64-bit word per row), or, without a mask, new token ``i`` sees new tokens ``0..i``
(causal). ``W > q_len`` is the multi-step draft, whose new nodes also see older tree nodes.

Split-K ("flash-decoding"): with ``num_splits > 1`` the keys of a sequence are cut into that many
chunks, each program writes a normalised partial output and its log-sum-exp, and a second small
kernel merges them. The number of splits is a launch constant, so the work is graph-safe; empty
chunks just write an empty partial.

Padding rows are harmless: a row that sees no key (``kv_len`` 0, or a dummy sequence of ``kv_len``
1 with ``q_len`` > 1) produces zeros, never NaN; keys past ``kv_len`` are never loaded.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tandem.kernels.pdl import pdl_enter, pdl_launch

_NO_KEY = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: exp2 of differences never gives NaN


@triton.jit
def _attend_tile(q, n0, end, m_i, l_i, acc, bt_row, k_head, v_head, row_info, tail_start,
                 scale_log2, stride_kp, stride_kt, stride_vp, stride_vt,
                 HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASK_W: tl.constexpr, IEEE_DOT: tl.constexpr):
    """One BLOCK_N-key step of online softmax; row_info is the mask bits (MASK_W > 0) or each row's last key."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < end
    d = tl.arange(0, HEAD_DIM)
    # One block-table entry per key (duplicates hit L1); int64 so huge pools cannot overflow.
    page = tl.load(bt_row + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    slot = n % PAGE_SIZE
    k_row = tl.multiple_of(page * stride_kp + slot * stride_kt, 8)  # lets the loads be 16-byte vectors
    k = tl.load(k_head + k_row[:, None] + d[None, :], mask=n_ok[:, None], other=0.0).to(q.dtype)
    if IEEE_DOT:  # float32 inputs: no tf32 rounding, so float32 results match the reference to ~1e-6
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale_log2
    if MASK_W > 0:
        j = n - tail_start
        shift = tl.where(j >= 0, j, 0).to(row_info.dtype)
        seen = ((row_info[:, None] >> shift[None, :]) & 1) != 0
        visible = (j < 0)[None, :] | seen
    else:
        visible = n[None, :] <= row_info[:, None]
    visible = visible & n_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_row = tl.multiple_of(page * stride_vp + slot * stride_vt, 8)
    v = tl.load(v_head + v_row[:, None] + d[None, :], mask=n_ok[:, None], other=0.0).to(q.dtype)
    if IEEE_DOT:
        pv = tl.dot(p.to(q.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _split_bounds(stop, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [start, end) this program attends: all ``stop`` of them, or its split's share in whole tiles."""
    if NUM_SPLITS == 1:
        start = stop * 0  # a tensor like the split branch's (what a jit function returns keeps one type)
        end = stop
    else:
        chunk = tl.cdiv(tl.cdiv(stop, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(stop, start + chunk)
    return start, end


@triton.jit
def _store_result(acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, split, tok, head, d, row_ok,
                  stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                  NUM_SPLITS: tl.constexpr):
    """Normalise the accumulated rows (rows that saw no key stay 0) and store them: the output, or this
    split's partial output and log-sum-exp for ``_merge_splits_kernel``."""
    has_key = l_i > 0.0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), _NO_KEY)
        # a row that saw no key in this split stores its lse alone: the merge reads no output of it (graphs size the
        # splits for the longest context, so at a short one most are empty)
        tl.store(part_o_ptr + split * stride_ps + tok[:, None] * stride_pt + head[:, None] * stride_ph + d[None, :],
                 o, mask=(row_ok & has_key)[:, None])
        tl.store(part_lse_ptr + split * stride_ls + tok * stride_lt + head, lse, mask=row_ok)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, kv_lens_ptr, mask_ptr, part_o_ptr, part_lse_ptr,
    q_len, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_bt, stride_mb, stride_mi, stride_mj,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_W: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE_DOT: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    q_tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    # Row r of the tile is query head kvh*GROUP + r%GROUP of new token q_tile*BLOCK_Q + r//GROUP.
    rows = tl.arange(0, BLOCK_M)
    qi = q_tile * BLOCK_Q + rows // GROUP
    row_ok = (rows < GROUP * BLOCK_Q) & (qi < q_len)
    tok = (b * q_len + qi).to(tl.int64)
    head = kvh * GROUP + rows % GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)

    if INTERPRET:
        q = q.to(tl.float32)  # the interpreter's tl.dot mishandles bf16 (stored as raw uint16)
    kv_len = tl.load(kv_lens_ptr + b)
    if MASK_W > 0:
        tail_start = kv_len - MASK_W  # first key the mask talks about
        # Bit j: the row sees key tail_start + j. 32-bit words when they suffice (fewer registers).
        bits_ty: tl.constexpr = tl.int32 if MASK_W <= 32 else tl.int64
        row_info = tl.zeros([BLOCK_M], dtype=bits_ty)
        for j in tl.static_range(MASK_W):
            seen = tl.load(mask_ptr + b * stride_mb + qi * stride_mi + j * stride_mj, mask=row_ok, other=0)
            row_info = row_info | ((seen != 0).to(bits_ty) << j)
        stop = kv_len
    else:
        tail_start = 0
        row_info = kv_len - q_len + qi  # causal: new token i sees keys up to its own
        # Keys after the tile's last row are invisible to the whole tile (prefill-like widths skip them).
        stop = tl.maximum(tl.minimum(kv_len, kv_len - q_len + (q_tile + 1) * BLOCK_Q), 0)

    start, end = _split_bounds(stop, split, NUM_SPLITS, BLOCK_N)

    m_i = tl.full([BLOCK_M], _NO_KEY, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh
    if INTERPRET:
        # The interpreter (numpy >= 2) cannot use a loaded scalar as a range() bound; a while loop
        # computes the same thing. Compiled code keeps the for loop, which Triton software-pipelines.
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _attend_tile(q, n0, end, m_i, l_i, acc, bt_row, k_head, v_head, row_info, tail_start,
                                         scale_log2, stride_kp, stride_kt, stride_vp, stride_vt,
                                         HEAD_DIM, PAGE_SIZE, BLOCK_N, MASK_W, IEEE_DOT)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, n0, end, m_i, l_i, acc, bt_row, k_head, v_head, row_info, tail_start,
                                         scale_log2, stride_kp, stride_kt, stride_vp, stride_vt,
                                         HEAD_DIM, PAGE_SIZE, BLOCK_N, MASK_W, IEEE_DOT)

    _store_result(acc, m_i, l_i, out_ptr, part_o_ptr, part_lse_ptr, split, tok, head, d, row_ok,
                  stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, NUM_SPLITS)


MERGE_D_BLOCK = 512  # output columns a merge program takes: a whole head (narrower blocks re-read every split's LSE, slower)


@triton.jit
def _merge_splits_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, num_heads,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, D_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.program_id(2) * D_BLOCK + tl.arange(0, D_BLOCK)
    lse = tl.load(part_lse_ptr + s * stride_ls + t * stride_lt + h)
    w = tl.exp2(lse - tl.max(lse, 0))  # every lse is finite (>= _NO_KEY), so no NaN
    # a split that saw no key wrote no output (its weight is 0, or all are equal and every output 0): not read
    o = tl.load(part_o_ptr + s[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
                mask=(lse > _NO_KEY)[:, None], other=0.0)
    merged = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, merged.to(out_ptr.dtype.element_ty))


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, pdl: dict) -> None:
    """``out[t, h]`` = the splits' partial outputs ``part_o[s, t, h]`` weighted by their log-sum-exps (base 2)."""
    num_splits, num_tokens, num_heads, head_dim = part_o.shape
    d_block = min(head_dim, MERGE_D_BLOCK)
    assert head_dim % d_block == 0, f"head dim {head_dim} is not whole blocks of {d_block} columns"
    _merge_splits_kernel[(num_tokens, num_heads, head_dim // d_block)](
        part_o, part_lse, out, num_heads,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, D_BLOCK=d_block, num_warps=4, **pdl,
    )


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch: int, num_kv_heads: int, max_kv_len: int, device: torch.device,
                       min_split_keys: int = 512) -> int:
    """Splits that fill the GPU when batch * kv heads leaves SMs idle; from shapes only (graph-safe).
    ``min_split_keys``: fewer keys than this per split are not worth one (per key work decides)."""
    if device.type != "cuda":
        return 1
    programs = batch * num_kv_heads
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    want = triton.next_power_of_2(max(1, -(-sms // programs)))
    if want > -(-sms // programs):
        want //= 2  # stay at or below one wave's worth of programs
    most = max(1, triton.next_power_of_2(max_kv_len // min_split_keys))
    return max(1, min(want, most, 32))


def paged_attention(
    q: torch.Tensor,  # [B * q_len, Hq, D], rotary applied; sequence b owns rows b*q_len .. b*q_len+q_len-1
    k_pool: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, max_pages]
    kv_lens: torch.Tensor,  # int32 [B]: cached + new keys, the new ones already in the pool
    scale: float,
    mask: torch.Tensor | None = None,  # bool/uint8 [B, q_len, W], q_len <= W <= 64, over the last W keys
    out: torch.Tensor | None = None,  # [B * q_len, Hq, D]; allocated in q's dtype when None
    num_splits: int | None = None,  # power of two; None: default_num_splits from the shapes
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pool.shape
    batch = kv_lens.shape[0]
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    q_len = num_tokens // batch
    group = num_heads // num_kv_heads
    if q_len * batch != num_tokens or group * num_kv_heads != num_heads:
        raise ValueError(f"q {tuple(q.shape)} does not split into {batch} sequences over {num_kv_heads} kv heads")
    if head_dim not in (16, 32, 64, 128, 256) or k_pool.shape[-1] != head_dim or v_pool.shape != k_pool.shape:
        raise ValueError(f"unsupported head_dim {head_dim} or pool shapes {tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    if q.stride(-1) != 1 or out.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("q, out and the pools need a contiguous last dimension")
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, block_tables.shape[1] * page_size, q.device)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")

    if mask is not None:
        mask_w = mask.shape[2]
        if mask.shape[:2] != (batch, q_len) or not q_len <= mask_w <= 64:
            raise ValueError(f"mask {tuple(mask.shape)} does not fit batch {batch}, q_len {q_len} (W <= 64)")
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)  # no copy: Triton reads bytes
        mask_strides = mask.stride()
    else:
        mask_w, mask_strides = 0, (0, 0, 0)
        mask = kv_lens  # never read; any pointer will do

    # Query rows per program: the whole group times up to 128/group new tokens (64..128 rows).
    block_q = min(triton.next_power_of_2(q_len), max(1, triton.next_power_of_2(128 // group + 1) // 2))
    block_m = max(16, triton.next_power_of_2(group * block_q))  # tl.dot needs >= 16 rows
    num_q_tiles = -(-q_len // block_q)
    block_n = 64 if block_m * head_dim <= 64 * 128 else 32
    num_warps = 4 if block_m <= 16 else 8  # 32-row tiles: 208 regs at 4 warps, 144 at 8

    if num_splits > 1:
        part_o = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
    else:
        part_o, part_lse = out, out  # never touched
    grid = (batch, num_kv_heads, num_q_tiles * num_splits)
    pdl = pdl_launch(q)
    _paged_attention_kernel[grid](
        q, k_pool, v_pool, out, block_tables, kv_lens, mask, part_o, part_lse,
        q_len, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.stride(0), *mask_strides,
        *(part_o.stride()[:3] if num_splits > 1 else (0, 0, 0)),
        *(part_lse.stride()[:2] if num_splits > 1 else (0, 0)),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        MASK_W=mask_w, NUM_SPLITS=num_splits, IEEE_DOT=q.dtype == torch.float32,
        INTERPRET=bool(triton.knobs.runtime.interpret),
        num_warps=num_warps, num_stages=3, **pdl,
    )
    if num_splits > 1:
        merge_splits(part_o, part_lse, out, pdl)
    return out
