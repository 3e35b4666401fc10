"""The staged-input scatter kernel (tandem/kernels/stage_inputs.py) against the torch copies it replaces in
TargetGraphRunner.prepare and PrefillFamily.stage, on the CPU under the Triton interpreter (on a GPU, compiled): every
static buffer poisoned first, padding rows behind the real ones, tables wider than one block of columns, masks for a
verify family, and a capture's padding alone (no real row, no pages)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit (import below)
pytest.importorskip("triton")

from tandem.engine.graph_buffers import GraphFamily, scatter_with_torch  # noqa: E402
from tandem.kernels.stage_inputs import scatter_staged  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
DUMMY = 0


def _poisoned(width: int, max_bs: int, table_cols: int) -> GraphFamily:
    fam = GraphFamily(width, max_bs, table_cols, page_size=16, device=torch.device(DEVICE))
    for t in (fam.input_ids, fam.positions, fam.slots, fam.kv_lens, fam.block_tables):
        t.fill_(-7)
    if fam.mask is not None:
        fam.mask.fill_(True)
    return fam


@pytest.mark.parametrize("width, n, bs, pages", [(1, 3, 3, 2), (1, 5, 8, 300), (4, 2, 3, 129), (3, 1, 1, 1),
                                                 (1, 0, 8, 0), (4, 0, 3, 0)])  # (no real row: a capture's padding)
def test_the_kernel_fills_the_static_buffers_as_the_torch_copies(width, n, bs, pages):
    g = torch.Generator().manual_seed(width * 100 + n)
    max_bs, table_cols = 8, 320
    masked = width > 1
    sizes = [bs * width] * 3 + [bs, n * pages, n * width * width if masked else 0]
    bounds = list(itertools.accumulate(sizes, initial=0))
    sent = torch.randint(1, 10_000, (bounds[-1],), generator=g)
    if masked:  # masks are 0 / 1
        sent[bounds[5]:] = torch.randint(0, 2, (bounds[6] - bounds[5],), generator=g)
    sent = sent.to(DEVICE)
    got, want = _poisoned(width, max_bs, table_cols), _poisoned(width, max_bs, table_cols)
    scatter_staged(sent, got.input_ids, got.positions, got.slots, got.kv_lens, got.block_tables, got.mask,
                   n, bs, width, pages, DUMMY)
    scatter_with_torch(want, sent, bounds, n, bs, pages)
    for name in ("input_ids", "positions", "slots", "kv_lens", "block_tables", "mask"):
        same = torch.equal(getattr(got, name), getattr(want, name)) if masked or name != "mask" else got.mask is None
        assert same, name
    assert (got.block_tables[n:bs] == DUMMY).all() and (got.block_tables[bs:] == -7).all()
    assert (got.block_tables[:n, pages:] == -7).all()  # (columns past the staged ones: as they were)
