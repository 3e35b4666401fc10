"""Reference multi-head latent attention (MLA) over the paged latent cache, in plain torch.

A layer's pool is ``[num_pages, page_size, 1, kv_lora + rope]``: per token the normalised ``c_kv`` and
the rotated ``k_pe`` (shared by all heads). Two forms of the same attention
(../shared/reference/deepseek_v3_kimi.md §2):

* **absorbed** (any shape: decode, chunks, chain and tree verification): the model folds ``W_UK``
  into the query, so every head attends to the cached entries as one MQA key head of width
  ``kv_lora + rope`` and value head ``c_kv`` (width ``kv_lora``); the model applies ``W_UV`` after.
* **plain** (a forward of fresh prompts only, no tree mask): keys and values expanded per head from
  the new tokens' latents, causal within each sequence — nothing cached is read.

Masks are the dense backends' (``AttentionMetadata.full_mask``): a tree verifies as it does there.
Correct on CPU and GPU; not fast: the reference the Triton kernel's route (tandem.attention.mla_triton_backend) is
tested against.
"""

from __future__ import annotations

import torch

from tandem.attention.metadata import AttentionMetadata
from tandem.attention.torch_backend import TorchAttentionBackend


class TorchMLABackend(TorchAttentionBackend):
    name = "torch-mla"
    fused_prologue = False  # MLAttention runs the reference norm, rotary and store
    fused_absorb = False  # ... and the absorbed projections as einsums

    def plan(self, meta: AttentionMetadata) -> None:
        super().plan(meta)
        # The plain form sees only the new tokens, so it needs every sequence fresh and causal.
        self.plain_prefill = all(p == 0 for p in meta.prefix_lens) and all(m is None for m in meta.tree_masks)

    @staticmethod
    def store(latent: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write the new tokens' entries ``[T, kv_lora + rope]`` at ``meta.slot_mapping``."""
        pool.view(-1, pool.shape[-1]).index_copy_(0, meta.slot_mapping, latent.to(pool.dtype))

    def forward_absorbed(self, q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, scale: float,
                         kv_lora_rank: int, merge: bool = True) -> torch.Tensor:
        """``q`` [T, H, kv_lora + rope] (absorbed nope part, then rotated pe) → ``Σ p_t c_t`` [T, H, kv_lora]
        (merged whatever ``merge`` says: nothing here is split)."""
        width = pool.shape[-1]
        out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
        for i in range(meta.num_seqs):
            start, end, entries = self._cached(pool, meta, i)
            entries = entries.reshape(-1, width).to(q.dtype)  # [kv_len, kv_lora + rope]
            query = q[start:end].transpose(0, 1)  # [H, q_len, width]
            out[start:end] = _attend(query, entries, entries[:, :kv_lora_rank], self._masks[i], scale).transpose(0, 1)
        return out

    def forward_plain(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
        """Fresh sequences only: ``q``/``k`` [T, H, nope + rope], ``v`` [T, H, v_dim] → [T, H, v_dim]."""
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for i in range(meta.num_seqs):
            start, end = self._cu[i], self._cu[i + 1]
            heads_first = [t[start:end].transpose(0, 1) for t in (q, k, v)]  # [H, q_len, *]
            out[start:end] = _attend(*heads_first, self._masks[i], scale).transpose(0, 1)
        return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(scale · q kᵀ, masked) v with the softmax in float32; ``k``/``v`` may be shared by all heads (2-D)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)
