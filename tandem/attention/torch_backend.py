"""Reference attention in plain torch: gather each sequence's pages, then scaled dot-product attention.

Correct for every shape the engine produces (prefill, decode, tree verification, chunks) on CPU and
GPU; not fast. It is what other backends are tested against. Long prompts are attended in blocks of query
rows, so the score matrix it materialises (heads x rows x keys, float32 where SDPA takes the math route)
stays under SCORE_BYTES: a 32k-token prompt on a GPU without FlashInfer would otherwise ask for 128 GiB.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention.backend import AttentionBackend
from tandem.attention.metadata import AttentionMetadata

SCORE_BYTES = 1 << 30  # the most one block's scores may take


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
            keys, values, mask = keys.to(q.dtype), values.to(q.dtype), self._masks[i]
            rows = max(1, SCORE_BYTES // (4 * q.shape[1] * keys.shape[1]))
            for first in range(start, end, rows):
                last = min(end, first + rows)
                query = q[first:last].transpose(0, 1)  # [Hq, rows, D]
                block_mask = None if mask is None else mask[first - start:last - start]
                attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=block_mask, scale=scale)
                out[first:last] = attended.transpose(0, 1)
        return out
