"""Attention inside CUDA graphs: Triton kernels that read only device tensors, so nothing needs
planning on the host before a replay.

Per layer: one kernel rotates q and k and stores k and v in the paged pool, one kernel attends
(decode, or a fixed-width tree / extension with its mask). The metadata is a GraphMeta of static
buffers (tandem.engine.graph_buffers) that the runner refills before each replay.
"""

from __future__ import annotations

import torch

from tandem.attention.backend import AttentionBackend


class TritonGraphBackend(AttentionBackend):
    name = "triton-graph"
    fuses_rotary = True

    def plan(self, meta) -> None:  # static buffers: nothing to prepare
        pass

    def forward(self, q, k, v, k_pool, v_pool, meta, scale: float) -> torch.Tensor:
        from tandem.kernels.paged_attention import paged_attention
        from tandem.kernels.rotary_kv import store_kv

        store_kv(k, v, k_pool, v_pool, meta.slot_mapping)
        return paged_attention(q, k_pool, v_pool, meta.block_tables, meta.kv_lens, scale, mask=meta.tree_mask)

    def forward_with_rotary(self, q, k, v, positions, rotary, k_pool, v_pool, meta, scale: float) -> torch.Tensor:
        return rotate_store_attend(q, k, v, positions, rotary, k_pool, v_pool, meta.slot_mapping, meta.block_tables,
                                   meta.kv_lens, meta.tree_mask, scale)


def rotate_store_attend(q, k, v, positions, rotary, k_pool, v_pool, slot_mapping, block_tables, kv_lens, mask,
                        scale: float) -> torch.Tensor:
    """Two kernels: rotary on q and k fused with the K/V store, then paged attention (``mask``: over the
    last W keys, or None). Shared by the target's graphs and the drafter's."""
    from tandem.kernels.paged_attention import paged_attention
    from tandem.kernels.rotary_kv import rotary_and_store

    q = rotary_and_store(q, k, v, rotary.cos, rotary.sin, positions, k_pool, v_pool, slot_mapping, q_out=torch.empty_like(q))
    return paged_attention(q, k_pool, v_pool, block_tables, kv_lens, scale, mask=mask)


def make_graph_backend(latent: bool = False):
    """The graphed forwards' attention: MLA's for a latent cache (tandem.attention.mla_graph_backend)."""
    if latent:
        from tandem.attention.mla_graph_backend import MLAGraphBackend

        return MLAGraphBackend()
    return TritonGraphBackend()
