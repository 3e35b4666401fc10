"""RMSNorm, computed in float32 and cast back, as the reference implementations do."""

from __future__ import annotations

import torch
from torch import nn

from tandem.layers.fast_path import use_triton
from tandem.layers.linear import check_shape


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def load_weight(self, param: str, tensor: torch.Tensor, shard_id: object = None) -> None:
        check_shape(tensor, tuple(self.weight.shape))
        self.weight.data.copy_(tensor)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``weight * rmsnorm(x)``; with ``residual``: ``(weight * rmsnorm(h), h)`` for ``h = x + residual``
        (the residual add fused into the norm, as the decoder layers use it)."""
        if use_triton(x):  # one kernel instead of five or six (same rounding: see tandem/kernels/norm.py)
            from tandem.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual=residual)
        if residual is not None:
            h = x + residual
            return self._norm(h), h
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
