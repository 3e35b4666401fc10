"""The attention-backend interface (the choice of backend: tandem.attention.choice).

A backend stores the new tokens' K/V into the paged pool and attends each new query to its
sequence's cached and new keys under the metadata's mask. ``plan`` runs once per forward (outside
CUDA graphs: it may allocate and look at host data); ``forward`` runs once per layer (inside graphs:
fixed shapes, no host synchronisation). The torch backend is the reference that runs everywhere;
FlashInfer (paged prefill with a custom mask, paged decode) arrives with the CUDA-graph work.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tandem.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str = "abstract"

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare for a forward over ``meta`` (called once, before the first layer)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D], rotary applied
        k: torch.Tensor,  # [T, Hkv, D], rotary applied
        v: torch.Tensor,  # [T, Hkv, D]
        k_pool: torch.Tensor,  # [num_pages, page_size, Hkv, D] of this layer
        v_pool: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write k/v at ``meta.slot_mapping``, then attend."""


def attend(backend: AttentionBackend, q, k, v, positions, rotary, k_pool, v_pool, meta, scale: float) -> torch.Tensor:
    """Rotary on q and k, K/V into the pool, attention: in one fused kernel plus the attention where the
    backend has it (``fuses_rotary``: the graphed GPU paths), else the rotary module then ``forward``."""
    if getattr(backend, "fuses_rotary", False):
        return backend.forward_with_rotary(q, k, v, positions, rotary, k_pool, v_pool, meta, scale)
    q, k = rotary(positions, q, k)
    return backend.forward(q, k, v, k_pool, v_pool, meta, scale)

