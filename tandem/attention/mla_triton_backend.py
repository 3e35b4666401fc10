"""MLA on the GPU: the absorbed form (decode, chunks, chain and tree verification) through the Triton
latent kernel (tandem/kernels/mla_attention.py); the plain form (fresh prompts) and the latent store
stay the torch reference's (tandem.attention.mla_torch_backend).

``plan`` packs the batch's tree masks once per forward into one device tensor ``[B, max_q_len, W]``
(W rounded up to 16, 32 or 64 so few kernel variants compile) with each sequence's own width beside
it; a batch whose tree is wider than 64 keys falls back to the reference for that forward.
"""

from __future__ import annotations

import torch

from tandem.attention.metadata import AttentionMetadata
from tandem.attention.mla_torch_backend import TorchMLABackend

MAX_MASK_WIDTH = 64  # the kernel packs a row's mask into one 64-bit word


class TritonMLABackend(TorchMLABackend):
    name = "triton-mla"

    def plan(self, meta: AttentionMetadata) -> None:
        self._max_q_len = max(meta.q_lens, default=0)
        widths = [0 if m is None else m.shape[1] for m in meta.tree_masks]
        widest = max(widths, default=0)
        self._kernel_fits = widest <= MAX_MASK_WIDTH
        self.plain_prefill = all(p == 0 for p in meta.prefix_lens) and not widest
        if self.plain_prefill or not self._kernel_fits:
            super().plan(meta)  # the torch paths' masks and host lengths (a device read-back the kernel avoids)
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
            self._mask = _to_device(packed, device)
            self._mask_widths = _to_device(torch.tensor(widths, dtype=torch.int32), device)

    def forward_absorbed(self, q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, scale: float,
                         kv_lora_rank: int) -> torch.Tensor:
        """``q`` [T, H, kv_lora + rope] (absorbed nope part, then rotated pe) → ``Σ p_t c_t`` [T, H, kv_lora]."""
        if not self._kernel_fits:
            return super().forward_absorbed(q, pool, meta, scale, kv_lora_rank)
        from tandem.kernels.mla_attention import mla_paged_attention

        return mla_paged_attention(q[..., :kv_lora_rank], q[..., kv_lora_rank:], pool, meta.block_tables,
                                   meta.kv_lens, meta.cu_q_lens, self._max_q_len, scale,
                                   mask=self._mask, mask_widths=self._mask_widths)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; to a GPU through pinned memory, so the copy queues without a sync."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
