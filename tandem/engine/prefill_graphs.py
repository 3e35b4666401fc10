"""CUDA graphs for short prompt chunks: a step of prompts (``prefill_apart``) replays one graph instead of
launching every kernel of an eager forward from the host.

One family per width (powers of two from 16 up to ``prefill_graph_tokens``), captured at batch buckets
1, 2, 4, ... ``prefill_graph_max_bs`` (tandem.prefill_shapes: the drafter's prompt-extend graphs share these
shapes). A batch of prompt chunks runs on the narrowest family that holds its longest chunk. Each chunk is LEFT-padded to the width, its real tokens the family's last rows:

- the attention's KV length stays the chunk's real one (prefix + tokens), and the causal kernels (no mask:
  new row i sees keys up to ``kv_len - width + i``) give real row ``width - L + j`` exactly the keys up to
  its own, ``prefix + j``. No key past ``kv_len`` is ever loaded — none this forward did not write, however
  stale or unset the KV (and the block table) past the chunk is;
- the padding rows before them see some of the cached keys or none (zeros, never NaN), write their KV
  into the dummy page, and are dropped;
- every sequence's logits row is its family's last row: the graph takes those rows ([bs, H], a strided
  view, no index buffer) before the LM head, so the head computes [bs, vocab], not [bs * width, vocab].

No mask: causal attention needs none, so the MLA kernel's 64-key mask limit does not bound the widths.
Features (EAGLE-3) are captured for every row when the runner's decode graphs capture them (a speculative
engine also captures a twin of each family without them, for prompts no drafter keeps); the caller gets the
real rows', packed in the eager path's order, by one gather after the replay.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from tandem.engine.graph_buffers import GraphFamily, own_float
from tandem.forward_batch import ForwardBatch
from tandem.kv_cache import DUMMY_PAGE
from tandem.prefill_shapes import padding_fits


def is_prompt_chunk(s) -> bool:
    """A chunk the prefill graphs take: causal, its positions the default, one logits row (its last)."""
    return s.logits == "last" and s.positions is None and s.tree_mask is None and s.device_ids is None


class PrefillFamily(GraphFamily):
    """The static buffers of one prefill width (causal: no mask), its buckets and its member key."""

    def __init__(self, width: int, buckets: list[int], max_pages: int, page_size: int, device: torch.device,
                 captures: bool = False):
        # its graphs' member in the runner (verify members are plain widths; a twin without features has its own)
        super().__init__(width, buckets[-1], max_pages, page_size, device, masked=False, captures=captures,
                         key=("prefill", width, captures))
        self.buckets = buckets
        self.feature_rows = torch.zeros(buckets[-1] * width, dtype=torch.int64, device=device)  # real rows, packed
        self.max_pages = max_pages
        # logits: [max_bs, vocab] (one row per sequence); features: [max_bs * width, F]

    @property
    def staging_size(self) -> int:
        """Values ``stage`` sends at most: ids, positions, slots, kv_lens, block tables, feature rows."""
        return self.buckets[-1] * (4 * self.width + 1 + self.max_pages)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def takes(self, batch: ForwardBatch) -> bool:
        """Room for the batch: sequences, the longest chunk, and the padding bound (tandem.prefill_shapes)."""
        lens = [len(s.token_ids) for s in batch.seqs]
        bs = self.bucket(len(lens))
        if bs is None or max(lens) > self.width:
            return False
        return padding_fits(bs, self.width, sum(lens))

    def stage(self, batch: ForwardBatch, staging) -> tuple[int, int, int]:
        """Fill the static inputs for ``batch`` (one host→device copy), each chunk left-padded and the bucket's
        rows past its sequences padding (their KV on the dummy page). → (bucket, sequences, real tokens)."""
        seqs = batch.seqs
        n, w, ps = len(seqs), self.width, self.page_size
        bs = self.bucket(n)
        lens = [len(s.token_ids) for s in seqs]
        real = sum(lens)
        max_pages = max(len(s.pages) for s in seqs)
        sizes = [bs * w, bs * w, bs * w, bs, n * max_pages, real]
        bounds = list(itertools.accumulate(sizes, initial=0))
        host = staging.host_array()
        ids, pos, slots, kv_lens, tables, rows = (host[a:b] for a, b in zip(bounds, bounds[1:]))
        tables = tables.reshape(n, max_pages)
        tables[:] = DUMMY_PAGE
        ids[:] = 0
        pos[:] = 0
        slots.reshape(bs, w)[:] = DUMMY_PAGE * ps + np.arange(w) % ps  # padding rows' KV: the dummy page
        kv_lens[n:] = w
        packed = 0
        for i, (s, length) in enumerate(zip(seqs, lens)):
            tables[i, : len(s.pages)] = s.pages
            keys = s.prefix_len + np.arange(length)
            first = (i + 1) * w - length  # the chunk's first row: the padding comes before it
            ids[first : (i + 1) * w] = s.token_ids
            pos[first : (i + 1) * w] = keys
            slots[first : (i + 1) * w] = tables[i, keys // ps] * ps + keys % ps
            kv_lens[i] = s.prefix_len + length
            rows[packed : packed + length] = np.arange(first, (i + 1) * w)
            packed += length
        sent = staging.send(bounds[-1])
        self.scatter(sent, bounds, n, bs, max_pages)  # (no mask: the feature rows are not read)
        self.feature_rows[:real].copy_(sent[bounds[5] : bounds[6]])
        return bs, n, real

    def run_model(self, runner, bs: int, layers: tuple[int, ...]) -> None:
        """What a graph of this family computes: the model over ``bs`` padded chunks, the LM head over each
        one's last row, into the static outputs."""
        w = self.width
        hidden, features = runner.model(self.input_ids[: bs * w], self.positions[: bs * w], self.meta(bs), runner.kv,
                                        runner.graph_backend, layers)
        logits = runner.model.logits(hidden.reshape(bs, w, -1)[:, -1])
        self.store(logits, features, self.buckets[-1], self.buckets[-1] * w)

    def outputs(self, n: int, real: int, features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After a replay: float32 logits of the ``n`` sequences' last tokens [n, V] and, when asked for, the
        features of their ``real`` tokens, packed as the eager path returns them [real, F] (else None); both
        tensors of their own, which the next replay leaves alone."""
        wanted = features and self.features is not None
        packed = self.features.index_select(0, self.feature_rows[:real]) if wanted else None
        return own_float(self.logits[:n]), packed
