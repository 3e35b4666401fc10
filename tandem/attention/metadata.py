"""What an attention backend needs to know about one forward: where each sequence's new tokens are,
which cached pages they extend, where their K/V go, and which new tokens may see which.

Every sequence contributes ``q_len`` new tokens appended after ``prefix_len`` cached ones. Prefill
(``prefix_len == 0``), decode (``q_len == 1``), chunked extension and tree verification are all this
one shape; a tree only adds ``tree_mask`` — a ``[q_len, W]`` boolean "row may attend to column"
matrix over the *last W* keys of the sequence (``W >= q_len``; the new tokens are the last ``q_len``
of them). Keys before those W are always visible. ``W == q_len`` is verification (the tree is all
new); ``W > q_len`` lets a multi-step draft see tree nodes written by earlier steps — its own
ancestors, not its cousins. Without a mask the new tokens are causal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    q_lens: list[int]  # new tokens per sequence
    prefix_lens: list[int]  # tokens already cached per sequence
    cu_q_lens: torch.Tensor  # int32 [B + 1], offsets of each sequence in the packed tokens
    kv_lens: torch.Tensor  # int32 [B], prefix_len + q_len
    block_tables: torch.Tensor  # int32 [B, max_pages]; unused entries are 0
    slot_mapping: torch.Tensor  # int64 [T], flat pool slot (page * page_size + offset) of each new token
    tree_masks: list[torch.Tensor | None]  # per sequence: bool [q_len, W <= kv_len] or None (causal)
    page_size: int
    host_block_tables: np.ndarray | None = None  # block_tables on the host, where the caller has them

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    def full_mask(self, i: int, device: torch.device) -> torch.Tensor | None:
        """Bool ``[q_len, prefix_len + q_len]`` mask of sequence ``i``; None means plain causal."""
        q_len, kv_len = self.q_lens[i], self.prefix_lens[i] + self.q_lens[i]
        tree = self.tree_masks[i]
        if tree is None:
            if q_len == 1:
                return None  # one new token sees everything
            tail = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
        else:
            tail = tree.to(device=device, dtype=torch.bool)
            if tail.shape[0] != q_len or not q_len <= tail.shape[1] <= kv_len:
                raise ValueError(f"tree mask of shape {tuple(tail.shape)} does not fit {q_len} new of {kv_len} keys")
        always_seen = torch.ones(q_len, kv_len - tail.shape[1], dtype=torch.bool, device=device)
        return torch.cat([always_seen, tail], dim=1)
