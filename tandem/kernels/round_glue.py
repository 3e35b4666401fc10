"""The device-side glue of a greedy chain round queued on the device (tandem.speculative.chain_rounds),
in three kernels instead of ~40 small torch ops between the round's graph replays.

A round is: draft graph → ``advance`` → verify graph → argmax → ``accept`` → draft-extend graph →
``settle``.
  * ``advance``: take the draft's chain (float64 rows as ``static_draft`` writes them) as int64 tokens
    (or the chains a caller rewrote), fold the draft's NaN flag into ``broken``, and stage the verify:
    its input ids, positions and KV lengths moved by the last round's counts, slots through the block
    tables (``TargetGraphRunner.advance``'s work).
  * ``accept``: the accepted drafts (the run of chain tokens equal to the target's argmax at the node
    before), the round's emitted tokens and count into the run's read-back buffer, and the extend's
    inputs: the kept tokens, their features (zero past the count) and the count.
  * ``settle``: after the extend, the next draft's inputs — the root (the last kept token), the
    advanced draft lengths, the extend's state and top-k copied into the draft's buffers.
Each is the torch code of chain_rounds / DraftGraphRunner.replay_extend, which the tests compare them
with (tests/test_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _advance_kernel(rows_ptr, chains_ptr, broken_ptr, by_ptr, ids_ptr, pos_ptr, kv_lens_ptr, slots_ptr, bt_ptr,
                    stride_rows, stride_bt, flag_col,
                    ND: tl.constexpr, BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_ROWS: tl.constexpr,
                    FROM_ROWS: tl.constexpr, HAS_BY: tl.constexpr, BY_CONST: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    ok = j < ND
    if HAS_ROWS:
        flag = tl.load(rows_ptr + b * stride_rows + flag_col)
        old = tl.load(broken_ptr + b)
        tl.store(broken_ptr + b, (old != 0) | (flag != 0))
    if FROM_ROWS:
        chain = tl.load(rows_ptr + b * stride_rows + j, mask=ok, other=0.0).to(tl.int64)
        tl.store(chains_ptr + b * ND + j, chain, mask=ok)
    else:
        chain = tl.load(chains_ptr + b * ND + j, mask=ok, other=0)
    tl.store(ids_ptr + b * ND + j, chain, mask=ok)
    pos = tl.load(pos_ptr + b * ND + j, mask=ok, other=0)
    if HAS_BY:
        by = tl.load(by_ptr + b)
        pos = pos + by
        tl.store(pos_ptr + b * ND + j, pos, mask=ok)
        tl.store(kv_lens_ptr + b, tl.load(kv_lens_ptr + b) + by.to(tl.int32))
    elif BY_CONST != 0:
        pos = pos + BY_CONST
        tl.store(pos_ptr + b * ND + j, pos, mask=ok)
        tl.store(kv_lens_ptr + b, tl.load(kv_lens_ptr + b) + BY_CONST)
    page = tl.load(bt_ptr + b * stride_bt + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    tl.store(slots_ptr + b * ND + j, page * PAGE_SIZE + pos % PAGE_SIZE, mask=ok)


def advance(rows: torch.Tensor | None, broken: torch.Tensor | None, by: torch.Tensor | int | None,
            input_ids: torch.Tensor, positions: torch.Tensor, kv_lens: torch.Tensor, slots: torch.Tensor,
            block_tables: torch.Tensor, page_size: int, nd: int, chains: torch.Tensor | None = None) -> torch.Tensor:
    """Stage the verify of n chains (``rows`` [n, 3nd+1] float64 from the draft; ``chains`` [n, nd] int64
    instead of the rows' tokens when given) in place: ``broken`` [n] bool |= the rows' NaN flag; the
    verify's ``input_ids`` [n*nd], ``positions`` [n*nd] int64 and ``kv_lens`` [n] int32 moved by
    ``by`` ([n] int64, or one int for all; None: not moved), ``slots`` [n*nd] int64 through ``block_tables``
    [n, P] int32. ``rows`` and ``broken`` None: no draft, ``chains`` are the tokens (a queued decode step,
    TargetGraphRunner.advance). → the chains [n, nd] int64."""
    from_rows = chains is None
    if from_rows:
        chains = torch.empty(rows.shape[0], nd, dtype=torch.int64, device=rows.device)
    n = chains.shape[0]
    by_tensor = by if torch.is_tensor(by) else None
    _advance_kernel[(n,)](
        rows if rows is not None else chains, chains, broken.view(torch.uint8) if broken is not None else chains,
        by_tensor if by_tensor is not None else kv_lens, input_ids, positions, kv_lens,
        slots, block_tables, rows.stride(0) if rows is not None else 0, block_tables.stride(0), 3 * nd,
        ND=nd, BLOCK=triton.next_power_of_2(nd), PAGE_SIZE=page_size, HAS_ROWS=rows is not None, FROM_ROWS=from_rows,
        HAS_BY=by_tensor is not None, BY_CONST=by if isinstance(by, int) else 0, **pdl_launch(chains))
    return chains


@triton.jit
def _accept_kernel(chains_ptr, argmax_ptr, broken_ptr, feat_ptr, emitted_ptr, ext_ids_ptr, ext_feat_ptr,
                   counts_ptr, aux_ptr, roots_ptr, stride_feat, stride_ext_feat, ext_width,
                   F: tl.constexpr, ND: tl.constexpr, BLOCK: tl.constexpr, BLOCK_F: tl.constexpr, HAS_ROOTS: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    node = tl.program_id(1)  # the node whose token and feature row this program feeds to the extend
    j = tl.arange(0, BLOCK)
    ok = j < ND
    best = tl.load(argmax_ptr + b * ND + j, mask=ok, other=0)
    # draft j+1 is accepted while it equals the target's argmax after node j: a cumulative product
    nxt = tl.load(chains_ptr + b * ND + j + 1, mask=j + 1 < ND, other=-1)
    match = (nxt == best) & (j + 1 < ND)
    first_miss = tl.min(tl.where(match, ND, j), axis=0)  # the first node whose next draft misses (ND - 1: none)
    broken = tl.load(broken_ptr + b) != 0
    count = tl.where(broken, 1, first_miss + 1).to(tl.int64)  # a broken draft: the root's token only
    kept = tl.where(j < count, best, 0)
    ext_row = b * ext_width + node
    if node == 0:
        tl.store(emitted_ptr + b * (ND + 2) + j, kept, mask=ok)
        tl.store(emitted_ptr + b * (ND + 2) + ND, count)
        tl.store(emitted_ptr + b * (ND + 2) + ND + 1, broken.to(tl.int64))
        tl.store(counts_ptr + b, count)
        tl.store(aux_ptr + b, count)
        if HAS_ROOTS:
            tl.store(roots_ptr + b, tl.load(roots_ptr + b) + count)
    tl.store(ext_ids_ptr + ext_row, tl.sum(tl.where(j == node, kept, 0), axis=0))
    live = node < count
    f = tl.arange(0, BLOCK_F)
    for f0 in range(0, F, BLOCK_F):
        f_ok = f0 + f < F
        x = tl.load(feat_ptr + (b * ND + node) * stride_feat + f0 + f, mask=f_ok & live, other=0.0)
        tl.store(ext_feat_ptr + ext_row * stride_ext_feat + f0 + f, x, mask=f_ok)


def accept(chains: torch.Tensor, argmax: torch.Tensor, broken: torch.Tensor, features: torch.Tensor,
           emitted: torch.Tensor, ext_token_ids: torch.Tensor, ext_features: torch.Tensor, aux: torch.Tensor,
           ext_width: int, roots: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy chain acceptance of n requests on the device: ``chains`` and ``argmax`` [n, nd] int64,
    ``broken`` [n] bool, ``features`` [n*nd, F] the verify's. Writes ``emitted`` [n, nd+2] (kept tokens,
    zero past the count | count | broken), the extend's first nd columns of ``ext_token_ids``
    [bs*ext_width] and rows of ``ext_features`` [bs*ext_width, F] (zero past the count), the count into
    ``aux`` [n], and adds it to ``roots`` [n] when given. → the counts [n] int64."""
    n, nd = chains.shape
    counts = torch.empty(n, dtype=torch.int64, device=chains.device)
    _accept_kernel[(n, nd)](
        chains, argmax, broken.view(torch.uint8), features, emitted, ext_token_ids, ext_features, counts, aux,
        roots if roots is not None else counts, features.stride(0), ext_features.stride(0),
        ext_width, F=features.shape[1], ND=nd, BLOCK=triton.next_power_of_2(nd), BLOCK_F=1024, HAS_ROOTS=roots is not None,
        **pdl_launch(chains))
    return counts


@triton.jit
def _settle_kernel(counts_ptr, ext_ids_ptr, aux_ptr, lens_ptr, state_ptr, out_state_ptr, logp_ptr, out_logp_ptr,
                   ids_ptr, out_ids_ptr, n, TW, ext_width, stride_state, stride_out_state, stride_logp,
                   stride_out_logp, stride_ids, stride_out_ids,
                   H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    if row < n:
        count = tl.load(counts_ptr + row)
        tl.store(aux_ptr + row, tl.load(ext_ids_ptr + row * ext_width + count - 1))  # the next draft's root
        tl.store(lens_ptr + row, tl.load(lens_ptr + row) + count)
    h = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        ok = h0 + h < H
        tl.store(state_ptr + row * stride_state + h0 + h,
                 tl.load(out_state_ptr + row * stride_out_state + h0 + h, mask=ok), mask=ok)
    t = tl.arange(0, BLOCK_T)
    t_ok = t < TW
    tl.store(logp_ptr + row * stride_logp + t, tl.load(out_logp_ptr + row * stride_out_logp + t, mask=t_ok), mask=t_ok)
    tl.store(ids_ptr + row * stride_ids + t, tl.load(out_ids_ptr + row * stride_out_ids + t, mask=t_ok), mask=t_ok)


def settle(counts: torch.Tensor, ext_token_ids: torch.Tensor, ext_width: int, aux: torch.Tensor, lens: torch.Tensor,
           state: torch.Tensor, out_state: torch.Tensor, top_logp: torch.Tensor, out_logp: torch.Tensor,
           top_ids: torch.Tensor, out_ids: torch.Tensor) -> None:
    """After the extend of n requests (``counts`` [n] tokens each, ``ext_token_ids`` [bs*ext_width]):
    ``aux`` [n] ← each one's last extended token (the next root), ``lens`` [n] += counts, and the first
    bs rows of ``state``, ``top_logp``, ``top_ids`` ← the extend's ``out_*`` (bs = out_state's rows)."""
    n, (bs, h), tw = counts.shape[0], out_state.shape, out_logp.shape[1]
    _settle_kernel[(bs,)](
        counts, ext_token_ids, aux, lens, state, out_state, top_logp, out_logp, top_ids, out_ids, n, tw, ext_width,
        state.stride(0), out_state.stride(0), top_logp.stride(0), out_logp.stride(0), top_ids.stride(0),
        out_ids.stride(0), H=h, BLOCK_H=1024, BLOCK_T=triton.next_power_of_2(tw), **pdl_launch(counts))
