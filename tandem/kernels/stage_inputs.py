"""Scatter a graph replay's staged inputs into its family's static buffers in one kernel.

``TargetGraphRunner.prepare`` packs a batch's inputs as int64 into the pinned staging buffer and copies it to the
device in one go (tandem.staging); from there they go into the family's static buffers: the token ids, positions
and KV slots (int64), the KV lengths and block tables (int32), the tree masks (bool), and the padding rows' block
tables set to the dummy page. As torch ops that is seven copies and a fill a fresh forward (``prepare``, mostly those,
was 8.7 % of a served engine thread's own time at concurrency 8 on the demo target). One launch here: 20 µs of host
time a call against 53 (bench/stage_scatter.py).

The staged layout (``bs`` rows of the bucket, ``n`` of them real, ``w`` tokens each, ``p`` page columns):
ids [bs*w] | positions [bs*w] | slots [bs*w] | kv_lens [bs] | tables [n, p] | masks [n, w, w] (when masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.pdl import pdl_enter, pdl_launch

_TABLE_BLOCK = 128


# (the counts vary with every batch: specialised on, each new value of 1 or a multiple of 16 would compile mid-serving)
@triton.jit(do_not_specialize=["n", "bs", "pages"])
def _scatter_kernel(src_ptr, ids_ptr, pos_ptr, slots_ptr, kv_lens_ptr, bt_ptr, mask_ptr, n, bs, pages, stride_bt,
                    TABLE_COLS: tl.constexpr, W: tl.constexpr, WB: tl.constexpr, WWB: tl.constexpr,
                    HAS_MASK: tl.constexpr, DUMMY: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    m = bs.to(tl.int64) * W
    j = tl.arange(0, WB)
    ok = j < W
    row = b * W + j
    tl.store(ids_ptr + row, tl.load(src_ptr + row, mask=ok, other=0), mask=ok)
    tl.store(pos_ptr + row, tl.load(src_ptr + m + row, mask=ok, other=0), mask=ok)
    tl.store(slots_ptr + row, tl.load(src_ptr + 2 * m + row, mask=ok, other=0), mask=ok)
    tl.store(kv_lens_ptr + b, tl.load(src_ptr + 3 * m + b).to(tl.int32))
    c = tl.arange(0, BLOCK)
    bt_row = bt_ptr + b * stride_bt
    real = b < n
    # a real row gets its staged pages; a padding row the dummy page in every column (a run queued on the device
    # looks its slots up as far as the run goes)
    cols_to_write = tl.where(real, pages, TABLE_COLS)
    tables = src_ptr + 3 * m + bs + b * pages
    for c0 in range(0, TABLE_COLS, BLOCK):  # (a real row's blocks past its pages write nothing)
        cols = c0 + c
        okc = cols < cols_to_write
        staged = tl.load(tables + cols, mask=okc & real, other=DUMMY)
        tl.store(bt_row + cols, staged.to(tl.int32), mask=okc)
    if HAS_MASK:
        k = tl.arange(0, WWB)
        okk = (k < W * W) & real
        masks = src_ptr + 3 * m + bs + n.to(tl.int64) * pages + b * W * W
        tl.store(mask_ptr + b * W * W + k, (tl.load(masks + k, mask=okk, other=0) != 0).to(tl.int8), mask=okk)


def scatter_staged(src: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   kv_lens: torch.Tensor, block_tables: torch.Tensor, mask: torch.Tensor | None,
                   n: int, bs: int, width: int, pages: int, dummy_page: int) -> None:
    """The staged inputs ``src`` (int64, the layout above) into a family's static buffers: rows [0, bs) of ids,
    positions, slots (int64 [max_bs * width]) and KV lengths (int32 [max_bs]); block tables (int32 [max_bs, P]):
    rows [0, n) get their ``pages`` columns staged, rows [n, bs) the dummy page in all P; ``mask`` (bool [max_bs,
    width, width], or None: no masks staged) rows [0, n)."""
    _scatter_kernel[(bs,)](
        src, input_ids, positions, slots, kv_lens, block_tables,
        mask.view(torch.int8) if mask is not None else kv_lens,
        n, bs, pages, block_tables.stride(0), TABLE_COLS=block_tables.shape[1], W=width,
        WB=triton.next_power_of_2(width), WWB=triton.next_power_of_2(width * width), HAS_MASK=mask is not None,
        DUMMY=dummy_page, BLOCK=_TABLE_BLOCK, **pdl_launch(src))
