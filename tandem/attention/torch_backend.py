"""Reference attention in plain torch: gather each sequence's pages, then scaled dot-product attention.

Correct for every shape the engine produces (prefill, decode, tree verification, chunks) on CPU and
GPU; not fast. It is what other backends are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention.backend import AttentionBackend
from tandem.attention.metadata import AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, meta: AttentionMetadata) -> None:
        self._masks = [meta.full_mask(i, meta.block_tables.device) for i in range(meta.num_seqs)]
        self._kv_lens = meta.kv_lens.tolist()
        self._cu = meta.cu_q_lens.tolist()

    def _cached(self, pool: torch.Tensor, meta: AttentionMetadata, i: int) -> tuple[int, int, torch.Tensor]:
        """Sequence ``i``'s rows (start, end) in this forward and its cached entries ``[kv_len, ...]``
        gathered from the paged ``pool``."""
        kv_len = self._kv_lens[i]
        pages = meta.block_tables[i, : -(-kv_len // pool.shape[1])]
        return self._cu[i], self._cu[i + 1], pool[pages].flatten(0, 1)[:kv_len]

    def forward(self, q, k, v, k_pool, v_pool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = k_pool.shape[2:]
        k_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_pool.dtype))
        v_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_pool.dtype))
        group = q.shape[1] // num_kv_heads
        out = torch.empty_like(q)
        for i in range(meta.num_seqs):
            start, end, keys = self._cached(k_pool, meta, i)  # keys [kv_len, Hkv, D]
            values = self._cached(v_pool, meta, i)[2]
            keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, kv_len, D]
            values = values.transpose(0, 1).repeat_interleave(group, dim=0)
            query = q[start:end].transpose(0, 1)  # [Hq, q_len, D]
            attended = F.scaled_dot_product_attention(
                query, keys.to(q.dtype), values.to(q.dtype), attn_mask=self._masks[i], scale=scale
            )
            out[start:end] = attended.transpose(0, 1)
        return out
