"""What an attention backend needs to know about one forward: where each sequence's new tokens are,
which cached pages they extend, where their K/V go, and which new tokens may see which.

Every sequence contributes ``q_len`` new tokens appended after ``prefix_len`` cached ones. Prefill
(``prefix_len == 0``), decode (``q_len == 1``), chunked extension and tree verification are all this
one shape; a tree only adds ``tree_mask`` — a ``[q_len, q_len]`` boolean "row may attend to column"
matrix among the new tokens (the prefix is always visible). Without it the new tokens are causal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    q_lens: list[int]  # new tokens per sequence
    prefix_lens: list[int]  # tokens already cached per sequence
    cu_q_lens: torch.Tensor  # int32 [B + 1], offsets of each sequence in the packed tokens
    kv_lens: torch.Tensor  # int32 [B], prefix_len + q_len
    block_tables: torch.Tensor  # int32 [B, max_pages]; unused entries are 0
    slot_mapping: torch.Tensor  # int64 [T], flat pool slot (page * page_size + offset) of each new token
    tree_masks: list[torch.Tensor | None]  # per sequence: bool [q_len, q_len] or None (causal)
    page_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    def full_mask(self, i: int, device: torch.device) -> torch.Tensor | None:
        """Bool ``[q_len, prefix_len + q_len]`` mask of sequence ``i``; None means plain causal."""
        q_len, prefix = self.q_lens[i], self.prefix_lens[i]
        tree = self.tree_masks[i]
        if tree is None:
            if q_len == 1:
                return None  # one new token sees everything
            new = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
        else:
            new = tree.to(device=device, dtype=torch.bool)
        seen_prefix = torch.ones(q_len, prefix, dtype=torch.bool, device=device)
        return torch.cat([seen_prefix, new], dim=1)
