"""SwiGLU's activation, ``silu(gate) * up`` over a fused gate/up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.layers.fast_path import use_triton


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[gate | up]`` ([..., 2I]) → ``silu(gate) * up`` ([..., I]): one Triton kernel on the GPU."""
    if use_triton(gate_up):
        from tandem.kernels.activation import silu_and_mul

        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
