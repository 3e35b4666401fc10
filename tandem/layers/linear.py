"""Tensor-parallel linear layers. Each class owns its shard arithmetic and its checkpoint loading.

Column-parallel layers split the output features across ranks (no communication in forward);
row-parallel layers split the input features and all-reduce their partial sums. Model code composes
them and never branches on the tensor-parallel size. ``load_weight`` receives the *full* checkpoint
tensor, checks its shape against what the config implies, and copies this rank's shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed import all_reduce, divide, tp_group
from tandem.layers import gemv_routes
from tandem.layers.fast_path import gemv_max_rows, use_triton


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + b``. Up to ``gemv_max_rows()`` bf16/fp16 rows on the GPU (by default one: batch-1
    decode), and the few-row products that tandem/layers/gemv_routes.py routes (a width-4 verify at
    batch 1: qkv, o, the LM head), go to the Triton GEMV (tandem/kernels/gemv.py), which streams W at
    the read bandwidth and joins the programmatic dependent launch chain of the other kernels;
    everything else, float32 included, is ``F.linear``."""
    if (x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1
            and weight.stride(1) == 1 and use_triton(x)):
        rows, (n, k) = x.shape[0], weight.shape
        route = gemv_routes.route(rows, n, k)  # (none for one row: that has its own kernel)
        if route is not None or 0 < rows <= gemv_max_rows():
            from tandem.kernels.gemv import GemvConfig, default_config, gemv

            return gemv(x, weight, bias, GemvConfig(**route) if route is not None else default_config(rows, n, k))
    return F.linear(x, weight, bias)


class ShapeMismatch(ValueError):
    """Raised by ``load_weight``; the loader turns it into a CheckpointError naming file and tensor."""

    def __init__(self, got: tuple[int, ...], expected: tuple[int, ...]):
        super().__init__(f"has shape {tuple(got)}, expected {tuple(expected)}")


def check_shape(tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ShapeMismatch(tuple(tensor.shape), expected)


class ReplicatedLinear(nn.Module):
    """A plain linear layer, the same on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load_weight(self, param: str, tensor: torch.Tensor, shard_id: object = None) -> None:
        target = getattr(self, param)
        check_shape(tensor, tuple(target.shape))
        target.data.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ with W split by output rows: each rank computes its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        tp = tp_group()
        self.in_features = in_features
        self.out_features = out_features
        self.local_out = divide(out_features, tp.size, "output features")
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.local_out), requires_grad=False) if bias else None

    def load_weight(self, param: str, tensor: torch.Tensor, shard_id: object = None) -> None:
        expected = (self.out_features, self.in_features) if param == "weight" else (self.out_features,)
        check_shape(tensor, expected)
        rank = tp_group().rank
        getattr(self, param).data.copy_(tensor.narrow(0, rank * self.local_out, self.local_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.bias)


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate and up).

    The local weight is ``[rank's slice of part 0; rank's slice of part 1; ...]``, so a forward yields
    each part's local slice back to back.
    """

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False):
        super().__init__()
        tp = tp_group()
        self.in_features = in_features
        self.part_sizes = list(part_sizes)
        self.local_parts = [divide(s, tp.size, "output features") for s in part_sizes]
        total = sum(self.local_parts)
        self.weight = nn.Parameter(torch.empty(total, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(total), requires_grad=False) if bias else None

    def load_weight(self, param: str, tensor: torch.Tensor, shard_id: object = None) -> None:
        part = int(shard_id)  # type: ignore[arg-type]
        full, local = self.part_sizes[part], self.local_parts[part]
        check_shape(tensor, (full, self.in_features) if param == "weight" else (full,))
        offset = sum(self.local_parts[:part])
        rank = tp_group().rank
        getattr(self, param).data.narrow(0, offset, local).copy_(tensor.narrow(0, rank * local, local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.bias)


class QKVParallelLinear(nn.Module):
    """Fused q/k/v projection split by attention heads.

    Query heads are divided among ranks. Key/value heads are divided too when there are at least as
    many as ranks; otherwise each kv head is replicated on the ranks whose query heads use it (GQA
    with tp > num_kv_heads).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        super().__init__()
        tp = tp_group()
        self.hidden_size, self.head_dim = hidden_size, head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.local_heads = divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.local_kv_heads = divide(num_kv_heads, tp.size, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.local_kv_heads
        else:
            divide(tp.size, num_kv_heads, "tensor-parallel size vs num_key_value_heads")
            self.local_kv_heads = 1
            self.kv_head_start = tp.rank // (tp.size // num_kv_heads)
        self.q_size = self.local_heads * head_dim
        self.kv_size = self.local_kv_heads * head_dim
        out = self.q_size + 2 * self.kv_size
        self.weight = nn.Parameter(torch.empty(out, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def load_weight(self, param: str, tensor: torch.Tensor, shard_id: object = None) -> None:
        rank = tp_group().rank
        heads = self.num_heads if shard_id == "q" else self.num_kv_heads
        full = heads * self.head_dim
        check_shape(tensor, (full, self.hidden_size) if param == "weight" else (full,))
        if shard_id == "q":
            src, dst = tensor.narrow(0, rank * self.q_size, self.q_size), (0, self.q_size)
        else:
            src = tensor.narrow(0, self.kv_head_start * self.head_dim, self.kv_size)
            dst = (self.q_size + (0 if shard_id == "k" else self.kv_size), self.kv_size)
        getattr(self, param).data.narrow(0, *dst).copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ with W split by input columns; partial sums are all-reduced, then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        tp = tp_group()
        self.in_features, self.out_features = in_features, out_features
        self.local_in = divide(in_features, tp.size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load_weight(self, param: str, tensor: torch.Tensor, shard_id: object = None) -> None:
        if param == "bias":
            check_shape(tensor, (self.out_features,))
            self.bias.data.copy_(tensor)
            return
        check_shape(tensor, (self.out_features, self.in_features))
        rank = tp_group().rank
        self.weight.data.copy_(tensor.narrow(1, rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(matmul(x, self.weight))
        return y + self.bias if self.bias is not None else y
