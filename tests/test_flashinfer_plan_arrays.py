"""The host side of FlashInfer's eager plan (tandem/attention/flashinfer_backend.py): the page arrays built with
numpy from the host's block tables equal those a per-sequence loop lists — each sequence's used pages in order,
the offsets between them, the last page's fill — for sequences of every length around page boundaries, scattered
pages and a padded table; the forward batch carries those host tables beside the device ones."""

from __future__ import annotations

import numpy as np
import torch

from tandem.attention.flashinfer_backend import _page_arrays, _plan_arrays
from tandem.forward_batch import ForwardBatch, SequenceChunk, to_device

PS = 4


def _reference(kv_lens, tables):
    indptr, indices, last = [0], [], []
    for i, n in enumerate(kv_lens):
        used = -(-n // PS)
        indices += [int(p) for p in tables[i, :used]]
        indptr.append(indptr[-1] + used)
        last.append(n - (used - 1) * PS)
    return indptr, indices, last


def test_page_arrays_list_each_sequences_used_pages_as_a_loop_does():
    rng = np.random.default_rng(0)
    kv_lens = [1, 3, 4, 5, 8, 9, 16, 17, 30]
    width = max(-(-n // PS) for n in kv_lens) + 2  # padded past the longest
    tables = rng.permutation(200)[: len(kv_lens) * width].reshape(len(kv_lens), width).astype(np.int32)
    indptr, indices, last = _page_arrays(kv_lens, tables, PS, torch.device("cpu"))
    want = _reference(kv_lens, tables)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == want
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


def test_the_plan_reads_the_forward_batchs_host_tables():
    chunks = [SequenceChunk([5, 6, 7], 6, [9, 2, 7]), SequenceChunk([1], 0, [4]), SequenceChunk([3, 3], 13, [8, 1, 6, 5])]
    dev = to_device(ForwardBatch(chunks), PS, torch.device("cpu"))
    assert np.array_equal(dev.meta.host_block_tables, dev.meta.block_tables.numpy())
    for kind in ("causal", "masked"):
        arrays = _plan_arrays(dev.meta, kind, torch.device("cpu"))
        want = _reference([9, 1, 15], dev.meta.host_block_tables)
        assert (arrays["indptr"].tolist(), arrays["indices"].tolist(), arrays["last"].tolist()) == want, kind
        assert arrays["qo_indptr"].tolist() == [0, 3, 4, 6]
