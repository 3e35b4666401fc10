"""The static buffers of the target's graph families (tandem.engine.cuda_graph, .prefill_graphs): what a
graph reads (token ids, positions, KV slots, block tables, KV lengths, masks) and the GraphMeta its
attention sees. The host refills them before every fresh replay: packed into one pinned buffer, copied in one go and
scattered on the device (``stage_uniform``, ``scatter``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from tandem.kv_cache import DUMMY_PAGE
from tandem.layers.fast_path import use_triton


@dataclass
class GraphMeta:
    """The attention metadata a graph reads: static tensors, filled before every replay."""

    num_seqs: int
    q_len: int  # tokens per sequence (the family's width)
    block_tables: torch.Tensor  # int32 [bs, max_pages]
    kv_lens: torch.Tensor  # int32 [bs]
    slot_mapping: torch.Tensor  # int64 [bs * q_len]
    tree_mask: torch.Tensor | None  # bool [bs, q_len, q_len] over the last q_len keys; None: causal
    page_size: int


class GraphFamily:
    """Static buffers of one width (its graphs are the runner's, keyed by member and bucket). ``masked``:
    a mask buffer for tree masks (verification); without it the attention is causal."""

    def __init__(self, width: int, max_bs: int, max_pages: int, page_size: int, device: torch.device,
                 masked: bool = True, captures: bool = False, key=None):
        """``captures``: its graphs output the EAGLE-3 features; ``key``: its graphs' member in the runner
        (default: the width)."""
        n = max_bs * width
        self.width = width
        self.captures = captures
        self.key = width if key is None else key
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device)
        self.kv_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        masked = masked and width > 1
        self.mask = torch.ones(max_bs, width, width, dtype=torch.bool, device=device) if masked else None
        # the mask of a sequence without a tree
        self.causal = np.tril(np.ones((width, width), dtype=np.int64)) if masked else None
        # One output buffer per family, written by every bucket's graph: the graphs' temporaries are
        # freed after capture and reused from the shared pool, so memory is the largest bucket's, not the sum.
        self.logits: torch.Tensor | None = None  # model dtype: [max_bs * width, vocab] (a prefill family: [max_bs, vocab])
        self.features: torch.Tensor | None = None  # [max_bs * width, 3H], when the family captures features
        self.page_size = page_size

    def store(self, logits: torch.Tensor, features: torch.Tensor | None, logit_rows: int, feature_rows: int) -> None:
        """Copy a forward's outputs into the family's static ones; the first call (the largest bucket's warm-up)
        allocates them, ``logit_rows`` and ``feature_rows`` long."""
        if self.logits is None:
            self.logits = torch.empty(logit_rows, logits.shape[1], dtype=logits.dtype, device=logits.device)
            if features is not None:
                self.features = torch.empty(feature_rows, features.shape[1], dtype=features.dtype,
                                            device=features.device)
        self.logits[: logits.shape[0]].copy_(logits)
        if features is not None:
            self.features[: features.shape[0]].copy_(features)

    def stage_uniform(self, seqs: list, bs: int, staging) -> int:
        """Fill the static inputs for ``seqs`` (``width`` new tokens each; none: a capture's padding) padded to bucket
        ``bs``: packed into ``staging`` (tandem.staging.PinnedStaging), one host→device copy, one ``scatter`` → the
        real rows. The bucket's rows past them are padding (their KV goes to the dummy page, key t at page
        block_tables[t // ps] = DUMMY_PAGE offset t % ps; they see only it); their block tables are the dummy page's
        on the device, every column: a queued run advances padding rows too, their slots looked up as far as it goes."""
        width, ps, n = self.width, self.page_size, len(seqs)
        m = width * n
        max_pages = max((len(s.pages) for s in seqs), default=0)
        sizes = [bs * width] * 3 + [bs, n * max_pages, n * width * width if self.mask is not None else 0]
        host = staging.host_array()
        bounds = list(itertools.accumulate(sizes, initial=0))
        ids, pos, slots, kv_lens, tables, masks = (host[a:b] for a, b in zip(bounds, bounds[1:]))
        tables = tables.reshape(n, max_pages)
        tables[:] = DUMMY_PAGE
        prefix = np.empty(n, dtype=np.int64)
        for i, s in enumerate(seqs):
            tables[i, : len(s.pages)] = s.pages
            ids[i * width : (i + 1) * width] = s.token_ids
            prefix[i] = s.prefix_len
        keys = prefix[:, None] + np.arange(width)  # [n, width] KV index of every new token
        slots[:m].reshape(n, width)[:] = tables[np.arange(n)[:, None], keys // ps] * ps + keys % ps
        pos[:m].reshape(n, width)[:] = keys  # unless positions are given
        kv_lens[:n] = prefix + width
        if bs > n:
            ids[m:] = 0
            pos[m:] = 0
            slots[m:].reshape(bs - n, width)[:] = np.arange(width) % ps + DUMMY_PAGE * ps
            kv_lens[n:] = width
        if self.mask is not None:
            masks = masks.reshape(n, width, width)
            masks[:] = self.causal  # unless a tree mask is given
        for i, s in enumerate(seqs):
            if s.positions is not None:
                pos[i * width : (i + 1) * width] = s.positions
            if s.tree_mask is not None and self.mask is not None:
                masks[i] = s.tree_mask
        self.scatter(staging.send(bounds[-1]), bounds, n, bs, max_pages)
        if any(s.device_ids is not None for s in seqs):  # draft tokens the host has not seen: copied on the device
            ids = self.input_ids[:m].view(n, width)
            on_device = torch.stack([s.device_ids if s.device_ids is not None else ids[i] for i, s in enumerate(seqs)])
            ids.copy_(torch.where(ids < 0, on_device, ids))
        return m

    def scatter(self, sent: torch.Tensor, bounds: list[int], n: int, bs: int, pages: int) -> None:
        """Inputs staged on the device (``sent``: ids, positions, slots [bs * width] each, KV lengths [bs], the ``n``
        real rows' block tables [n, pages], then masks [n, width, width] where the family has them; ``bounds``
        the parts' offsets) into the static buffers, the padding rows' tables the dummy page: on a GPU in one
        kernel (tandem.kernels.stage_inputs), not seven copies and a fill (20 against 53 µs of host time a call)."""
        if use_triton(sent):
            from tandem.kernels.stage_inputs import scatter_staged

            scatter_staged(sent, self.input_ids, self.positions, self.slots, self.kv_lens, self.block_tables, self.mask,
                           n, bs, self.width, pages, DUMMY_PAGE)
        else:
            scatter_with_torch(self, sent, bounds, n, bs, pages)

    def meta(self, bs: int) -> GraphMeta:
        w = self.width
        return GraphMeta(bs, w, self.block_tables[:bs], self.kv_lens[:bs], self.slots[: bs * w],
                         self.mask[:bs] if self.mask is not None else None, self.page_size)


def scatter_with_torch(fam: GraphFamily, sent: torch.Tensor, bounds: list[int], n: int, bs: int, pages: int) -> None:
    """``GraphFamily.scatter`` as torch copies (the CPU's way, and the kernel's reference)."""
    ids, pos, slots, kv_lens, tables = (sent[a:b] for a, b in zip(bounds[:5], bounds[1:6]))
    m = bs * fam.width
    fam.input_ids[:m].copy_(ids)
    fam.positions[:m].copy_(pos)
    fam.slots[:m].copy_(slots)
    fam.kv_lens[:bs].copy_(kv_lens)
    fam.block_tables[:n, :pages].copy_(tables.view(n, pages))
    fam.block_tables[n:bs].fill_(DUMMY_PAGE)  # (every column: a run queued on the device looks padding rows' slots up)
    if fam.mask is not None:
        fam.mask[:n].copy_(sent[bounds[5] : bounds[6]].view(n, fam.width, fam.width))


def own_float(logits: torch.Tensor) -> torch.Tensor:
    """The logits as float32 in a tensor of their own: in float32 ``.float()`` would return the static
    buffer itself, which the family's next replay overwrites under a caller that keeps them."""
    return logits.clone() if logits.dtype == torch.float32 else logits.float()
