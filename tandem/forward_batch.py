"""ForwardBatch: the host-side description of one forward, which rank 0 builds and broadcasts.

It is plain host data (lists of ints, int32 block tables, small boolean masks), so every rank turns
the same description into the same device tensors; ranks can never disagree about what they compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.attention.metadata import AttentionMetadata
from tandem.staging import upload


@dataclass(eq=False)  # holds arrays and tensors: compared by identity
class SequenceChunk:
    token_ids: list[int]  # the new tokens of this sequence in this forward
    prefix_len: int  # tokens of this sequence already in the KV cache
    pages: Sequence[int]  # block table covering prefix_len + len(token_ids) tokens (list, or SequenceKV.page_table())
    positions: list[int] | None = None  # rotary positions; default prefix_len + 0..n-1
    tree_mask: list[list[bool]] | None = None  # [n, W]: row sees column among the last W keys; None = causal
    logits: str = "last"  # which new tokens need logits: "last", "all" or "none"
    logits_from: int = 0  # with "all": the first of the new tokens that does (a prompt scored from a later position)
    # Token ids still on rank 0's device, for the entries of token_ids that are -1 (a chain draft the
    # verify takes straight from the drafter; see tandem.speculative.tree.PendingTokens).
    device_ids: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    seqs: list[SequenceChunk]
    capture_features: bool = False
    extra: dict = field(default_factory=dict)  # room for later fields without changing the wire shape

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def with_host_tokens(self) -> "ForwardBatch":
        """This batch with every token id on the host (one device→host copy when some are not): what
        the eager path and the other tensor-parallel ranks need."""
        waiting = [s for s in self.seqs if s.device_ids is not None]
        if not waiting:
            return self
        flat = iter(torch.cat([s.device_ids for s in waiting]).tolist())
        filled = {id(s): [d if t < 0 else t for t, d in zip(s.token_ids, flat)] for s in waiting}
        seqs = [dataclasses.replace(s, token_ids=filled[id(s)], device_ids=None) if id(s) in filled else s
                for s in self.seqs]
        return dataclasses.replace(self, seqs=seqs)


@dataclass
class DeviceBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [N], rows of the packed tokens whose logits are returned
    logits_counts: list[int]  # per sequence, how many rows of logits it owns (in order)


def to_device(batch: ForwardBatch, page_size: int, device: torch.device) -> DeviceBatch:
    ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    logits_rows: list[int] = []
    counts: list[int] = []
    cu = [0]
    max_pages = max(len(s.pages) for s in batch.seqs)
    tables = np.zeros((len(batch.seqs), max(1, max_pages)), dtype=np.int32)
    for i, s in enumerate(batch.seqs):
        n = len(s.token_ids)
        if n == 0:
            raise ValueError("a sequence in a forward batch has no new tokens")
        if len(s.pages) * page_size < s.prefix_len + n:
            raise ValueError(f"sequence {i}: {len(s.pages)} pages cannot hold {s.prefix_len + n} tokens")
        start = cu[-1]
        ids.extend(s.token_ids)
        keys = np.arange(s.prefix_len, s.prefix_len + n)  # a prompt's positions and slots in one pass each
        positions.append(keys if s.positions is None else np.asarray(s.positions, dtype=np.int64))
        tables[i, : len(s.pages)] = s.pages
        slots.append(tables[i, keys // page_size].astype(np.int64) * page_size + keys % page_size)
        rows = {"last": [start + n - 1], "all": list(range(start + s.logits_from, start + n)), "none": []}[s.logits]
        logits_rows.extend(rows)
        counts.append(len(rows))
        cu.append(start + n)
    q_lens = [len(s.token_ids) for s in batch.seqs]
    prefix_lens = [s.prefix_len for s in batch.seqs]
    # (every array through pinned memory: an eager forward's inputs queue behind the device's work, no sync)
    meta = AttentionMetadata(
        q_lens=q_lens,
        prefix_lens=prefix_lens,
        cu_q_lens=upload(np.asarray(cu, dtype=np.int32), device),
        kv_lens=upload(np.asarray([p + q for p, q in zip(prefix_lens, q_lens)], dtype=np.int32), device),
        block_tables=upload(tables, device),
        slot_mapping=upload(np.concatenate(slots), device),
        tree_masks=[torch.tensor(s.tree_mask, dtype=torch.bool) if s.tree_mask is not None else None for s in batch.seqs],
        page_size=page_size,
        host_block_tables=tables,
    )
    return DeviceBatch(
        input_ids=upload(np.asarray(ids, dtype=np.int64), device),
        positions=upload(np.concatenate(positions), device),
        meta=meta,
        logits_indices=upload(np.asarray(logits_rows, dtype=np.int64), device),
        logits_counts=counts,
    )
