"""MLA on the GPU: the absorbed form (decode, chunks, chain and tree verification) through the Triton
latent kernel (tandem/kernels/mla_attention.py); the plain form (fresh prompts) through torch's
``scaled_dot_product_attention`` with ``is_causal`` (on a GPU torch picks a fused kernel where one fits
— the memory-efficient one takes v narrower than q and k — so no score matrix or mask is built, unlike
in the reference); the latent store is the reference's (tandem.attention.mla_torch_backend).
Planning reads only host data (a fallback aside), so a forward never waits for the device.

``plan`` packs the batch's tree masks once per forward into one device tensor ``[B, max_q_len, W]``
(W rounded up to 16, 32 or 64 so few kernel variants compile) with each sequence's own width beside
it; a batch whose tree is wider than 64 keys falls back to the reference for that forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention.metadata import AttentionMetadata
from tandem.attention.mla_torch_backend import TorchMLABackend
from tandem.staging import upload

MAX_MASK_WIDTH = 64  # the kernel packs a row's mask into one 64-bit word


class TritonMLABackend(TorchMLABackend):
    name = "triton-mla"
    fused_prologue = True  # tandem/kernels/mla_prologue.py
    fused_absorb = True  # tandem/kernels/mla_absorb.py (up to its MAX_ROWS rows)

    def plan(self, meta: AttentionMetadata) -> None:
        self._max_q_len = max(meta.q_lens, default=0)
        widths = [0 if m is None else m.shape[1] for m in meta.tree_masks]
        widest = max(widths, default=0)
        self._kernel_fits = widest <= MAX_MASK_WIDTH
        self.plain_prefill = all(p == 0 for p in meta.prefix_lens) and not widest
        self._q_starts = [0]
        for q_len in meta.q_lens:
            self._q_starts.append(self._q_starts[-1] + q_len)
        if not self._kernel_fits:
            super().plan(meta)  # the reference's masks and lengths (it reads the lengths back from the device)
        self._mask = self._mask_widths = None
        if widest and self._kernel_fits:
            packed_width = next(w for w in (16, 32, 64) if w >= widest)
            packed = torch.zeros(meta.num_seqs, self._max_q_len, packed_width, dtype=torch.bool)
            for i, tree in enumerate(meta.tree_masks):
                if tree is not None:
                    q_len, kv_len = meta.q_lens[i], meta.prefix_lens[i] + meta.q_lens[i]
                    if tree.shape[0] != q_len or not q_len <= tree.shape[1] <= kv_len:
                        raise ValueError(f"tree mask of shape {tuple(tree.shape)} does not fit sequence {i}")
                    packed[i, : tree.shape[0], : tree.shape[1]] = tree
            device = meta.block_tables.device
            self._mask = upload(packed, device)
            self._mask_widths = upload(torch.tensor(widths, dtype=torch.int32), device)

    def forward_absorbed(self, q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, scale: float,
                         kv_lora_rank: int, merge: bool = True):
        """``q`` [T, H, kv_lora + rope] (absorbed nope part, then rotated pe) → ``Σ p_t c_t`` [T, H, kv_lora] (not
        ``merge``: the kernel's splits unmerged where it has several, tandem.kernels.mla_attention.LatentSplits)."""
        if not self._kernel_fits:
            return super().forward_absorbed(q, pool, meta, scale, kv_lora_rank)
        from tandem.kernels.mla_attention import mla_paged_attention

        return mla_paged_attention(q[..., :kv_lora_rank], q[..., kv_lora_rank:], pool, meta.block_tables,
                                   meta.kv_lens, meta.cu_q_lens, self._max_q_len, scale,
                                   mask=self._mask, mask_widths=self._mask_widths, merge=merge)

    def forward_plain(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
        """Fresh sequences only: ``q``/``k`` [T, H, nope + rope], ``v`` [T, H, v_dim] → [T, H, v_dim], causal."""
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for start, end in zip(self._q_starts, self._q_starts[1:]):
            heads_first = [t[start:end].transpose(0, 1) for t in (q, k, v)]  # [H, q_len, *]
            out[start:end] = F.scaled_dot_product_attention(*heads_first, is_causal=True, scale=scale).transpose(0, 1)
        return out
