"""Rotary position embedding with explicit per-token positions (tree nodes reuse positions).

The cos/sin table is built once for all positions up to the model's maximum, so a forward is a
gather by position. Frequencies follow the Hugging Face definitions, including llama3 scaling.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.configs.model import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inverse_frequencies(head_dim, rope))
        angles = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D]; positions: [T]
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
