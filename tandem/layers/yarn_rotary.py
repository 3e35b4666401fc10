"""DeepSeek's rotary embedding on the ``qk_rope_head_dim`` dims of MLA: YaRN frequencies, cos/sin
scaled by YaRN's attention factor, and the interleaved (GPT-J) pairing ``(x0, x1), (x2, x3), ...``.

Frequencies follow transformers' ``_compute_yarn_parameters`` (truncated correction range). The
interleaved output keeps each pair in place (SGLang's layout), where transformers de-interleaves it;
q and k are laid out alike, so their dot products — all attention sees — are the same.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.configs.deepseek import MlaConfig


def yarn_inverse_frequencies(dim: int, cfg: MlaConfig) -> torch.Tensor:
    pos_freqs = cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    yarn = cfg.yarn
    if yarn is None:
        return inv_freq

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # high-frequency dims keep their frequency, low-frequency ones are slowed by factor
    return 1.0 / (yarn.factor * pos_freqs) * ramp + inv_freq * extrapolate


class YarnRotary(nn.Module):
    def __init__(self, cfg: MlaConfig, max_positions: int):
        super().__init__()
        dim = cfg.qk_rope_head_dim
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), yarn_inverse_frequencies(dim, cfg))
        factor = cfg.yarn.attention_factor if cfg.yarn is not None else 1.0
        self.interleave = cfg.rope_interleave
        self.register_buffer("cos", freqs.cos() * factor, persistent=False)  # [max_positions, dim / 2]
        self.register_buffer("sin", freqs.sin() * factor, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, ..., dim] rotated by each token's position (``positions`` [T])."""
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
        cos = self.cos[positions].view(shape).to(x.dtype)
        sin = self.sin[positions].view(shape).to(x.dtype)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
