"""MLA inside CUDA graphs: decode and fixed-width verification of a latent-cache model (DeepSeek-V3,
Kimi-K2) on the static buffers of tandem.engine.graph_buffers' GraphMeta.

Always the absorbed form (every graphed forward extends cached sequences), through the Triton latent
kernel (tandem/kernels/mla_attention.py), which picks its splits from the shapes only; the latent's norm,
rotary and store run before it in one launch (``fused_prologue``: tandem/kernels/mla_prologue.py), and at
up to 8 rows the projections on either side of it in one launch each (``fused_absorb``:
tandem/kernels/mla_absorb.py), the first of which also runs the prologue. Nothing is planned on the host. The
kernel's per-sequence offsets and mask widths are uniform in a graph (every sequence has the family's width):
device tensors made once per width, outside capture (a family's largest bucket runs first, in its warm-up).
"""

from __future__ import annotations

import torch


class MLAGraphBackend:
    name = "triton-mla-graph"
    fused_prologue = True  # tandem/kernels/mla_prologue.py
    fused_absorb = True  # tandem/kernels/mla_absorb.py (up to its MAX_ROWS rows)
    plain_prefill = False  # a graph never holds a fresh prompt

    def __init__(self):
        self._uniform: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        # Outgrown offsets stay alive: graphs captured on them (a prefill family and a verify family of one
        # width, different largest buckets) still read them.
        self._outgrown: list[tuple[torch.Tensor, torch.Tensor]] = []

    def plan(self, meta) -> None:  # static buffers: nothing to prepare
        pass

    def _offsets(self, bs: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_q_lens [bs + 1], mask widths [bs]) of ``bs`` sequences of ``width`` new tokens each."""
        held = self._uniform.get((width, device))
        if held is None or held[1].shape[0] < bs:
            if held is not None:
                self._outgrown.append(held)
            held = self._uniform[(width, device)] = (
                torch.arange(bs + 1, dtype=torch.int32, device=device) * width,
                torch.full((bs,), width, dtype=torch.int32, device=device))
        return held[0][: bs + 1], held[1][:bs]

    def forward_absorbed(self, q: torch.Tensor, pool: torch.Tensor, meta, scale: float,
                         kv_lora_rank: int, merge: bool = True):
        """``q`` [bs * width, H, kv_lora + rope] → ``Σ p_t c_t`` [bs * width, H, kv_lora] (not ``merge``: the
        kernel's splits unmerged where it has several, tandem.kernels.mla_attention.LatentSplits)."""
        from tandem.kernels.mla_attention import mla_paged_attention

        cu_q_lens, widths = self._offsets(meta.num_seqs, meta.q_len, q.device)
        return mla_paged_attention(q[..., :kv_lora_rank], q[..., kv_lora_rank:], pool, meta.block_tables,
                                   meta.kv_lens, cu_q_lens, meta.q_len, scale, mask=meta.tree_mask,
                                   mask_widths=widths if meta.tree_mask is not None else None, merge=merge)
