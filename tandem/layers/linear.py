"""Tensor-parallel linear layers. Each class owns its shard arithmetic; loading is shared.

Column-parallel layers split the output features across ranks (no communication in forward);
row-parallel layers split the input features and all-reduce their partial sums. Model code composes
them and never branches on the tensor-parallel size. Each class describes its shard as ``Span``s (which
rows and columns of a checkpoint tensor land where in this rank's weight); ``load_weight`` receives the
*full* checkpoint tensor, checks its shape and copies this rank's shard. A layer built with a
``quant`` format (tandem/layers/quantized_linear.py) holds that format's packed tensors instead of
``weight`` and loads them through the same spans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed import all_reduce, divide, tp_group
from tandem.layers import fast_path, gemv_routes
from tandem.layers.activation import silu_mul
from tandem.layers.fast_path import gemv_max_rows, use_triton


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """``x Wᵀ + b``. Up to ``gemv_max_rows()`` bf16/fp16 rows on the GPU (by default one: batch-1
    decode), and the few-row products that tandem/layers/gemv_routes.py routes (a width-4 verify at
    batch 1: qkv, o, the LM head), go to the Triton GEMV (tandem/kernels/gemv.py), which streams W at
    the read bandwidth and joins the programmatic dependent launch chain of the other kernels;
    everything else, float32 included, is ``F.linear``. ``swiglu``: x is ``[..., 2K]`` (gate | up) and the
    product is with ``silu(gate) * up``, which the GEMV's "rows" kernel reads directly (one launch less)."""
    if (x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1
            and weight.stride(1) == 1 and use_triton(x)):
        rows, (n, k) = x.shape[0], weight.shape
        route = gemv_routes.route(rows, n, k)  # (none for one row: that has its own kernel)
        if route is not None or 0 < rows <= gemv_max_rows():
            from tandem.kernels.gemv import GemvConfig, default_config, gemv

            config = GemvConfig(**route) if route is not None else default_config(rows, n, k)
            if not swiglu or config.kernel == "rows":
                return gemv(x, weight, bias, config, swiglu=swiglu)
    return F.linear(silu_mul(x) if swiglu else x, weight, bias)


def norm_gemv_applies(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether a one-row GEMV (tandem/kernels/gemv.py) may apply RMSNorm(h + residual) to its input itself: on
    (``fast_path.FUSE_INPUT_NORMS``), one contiguous bf16/fp16 row on the GPU, the residual and the norm's weight
    alike."""
    return (fast_path.FUSE_INPUT_NORMS and h.dim() == 2 and h.shape[0] == 1
            and h.dtype in (torch.bfloat16, torch.float16) and norm_weight.dtype == h.dtype
            and residual.shape == h.shape and residual.dtype == h.dtype
            and h.is_contiguous() and residual.is_contiguous() and use_triton(h))


def norm_gemv_config(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor):
    """The one-row GEMV tile that applies RMSNorm(h + residual) to its input itself (``norm_gemv_applies``, a weight
    in h's dtype), or None where the norm runs first — also where its programs would recompute more activations
    than ``activation.fold_norm`` allows (each reads the whole row)."""
    if not (norm_gemv_applies(h, residual, norm_weight) and gemv_max_rows() >= 1 and weight.dtype == h.dtype
            and weight.stride(1) == 1):
        return None
    from tandem.kernels.activation import fold_norm
    from tandem.kernels.gemv import default_config

    n, k = weight.shape
    config = default_config(1, n, k)
    fits = config.kernel == "rows" and fold_norm(-(-n // config.block_n) * k)
    return config if fits else None


class ShapeMismatch(ValueError):
    """Raised by ``load_weight``; the loader turns it into a CheckpointError naming file and tensor."""

    def __init__(self, got: tuple[int, ...], expected: tuple[int, ...]):
        super().__init__(f"has shape {tuple(got)}, expected {tuple(expected)}")


def check_shape(tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ShapeMismatch(tuple(tensor.shape), expected)


@dataclass(frozen=True)
class Span:
    """One dimension of a shard: ``length`` entries from ``src`` of the checkpoint tensor's ``full`` go
    to ``dst`` of this rank's ``local``."""

    src: int
    dst: int
    length: int
    full: int
    local: int

    @classmethod
    def whole(cls, n: int) -> "Span":
        return cls(0, 0, n, n, n)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dst, src)`` narrowed to this span along ``dim``."""
        return dst.narrow(dim, self.dst, self.length), src.narrow(dim, self.src, self.length)


class ShardedLinear(nn.Module):
    """Shared weights, loading and forward; subclasses set ``rows(shard_id)`` and ``cols``."""

    def _make_weights(self, out_local: int, in_local: int, bias: bool, quant) -> None:
        self.quant = quant
        if quant is None:
            self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        else:
            quant.create(self, out_local, in_local)
        self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False) if bias else None

    def row_spans(self) -> list[Span]:
        """Every piece of this rank's output rows (for quantized formats to check block alignment)."""
        return [self.rows(None)]

    def rows(self, shard_id: object) -> Span:
        raise NotImplementedError

    def load_weight(self, param: str, tensor: torch.Tensor, shard_id: object = None) -> None:
        rows = self.rows(shard_id)
        if param == "bias":
            check_shape(tensor, (rows.full,))
            dst, src = rows.copy(self.bias.data, tensor, 0)
            dst.copy_(src)
        elif self.quant is not None:
            self.quant.load(self, param, tensor, rows, self.cols)
        else:
            check_shape(tensor, (rows.full, self.cols.full))
            dst, src = rows.copy(self.weight.data, tensor, 0)
            dst, src = self.cols.copy(dst, src, 1)
            dst.copy_(src)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None, swiglu: bool = False) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply(self, x, bias, swiglu)
        return matmul(x, self.weight, bias, swiglu)

    def forward(self, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """``x Wᵀ (+ b)``; ``swiglu``: of ``silu(gate) * up`` for x = [gate | up] (see ``matmul``)."""
        return self._outputs(self._product(x, self.bias, swiglu))

    def _outputs(self, y: torch.Tensor):
        """The product as the layer hands it on (QKVAProjection splits it)."""
        return y

    def forward_normed(self, h: torch.Tensor, residual: torch.Tensor, norm):
        """``(forward(x), h + residual, x)`` for ``x, _ = norm(h, residual)`` (an RMSNorm): one launch where the
        one-row GEMV applies the norm itself (``norm_gemv_config``; x is then None: never written)."""
        config = None if self.quant is not None else norm_gemv_config(h, residual, norm.weight, self.weight)
        if config is None:
            x, stream = norm(h, residual)
            return self.forward(x), stream, x
        from tandem.kernels.gemv import InputNorm, gemv

        stream = torch.empty_like(h)
        y = gemv(h, self.weight, self.bias, config, norm=InputNorm(residual, norm.weight, norm.eps, stream))
        return self._outputs(y), stream, None


class ReplicatedLinear(ShardedLinear):
    """A plain linear layer, the same on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.cols = Span.whole(in_features)
        self._make_weights(out_features, in_features, bias, quant)

    def rows(self, shard_id: object) -> Span:
        return Span.whole(self.out_features)


class ColumnParallelLinear(ShardedLinear):
    """y = x Wᵀ with W split by output rows: each rank computes its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant=None):
        super().__init__()
        tp = tp_group()
        self.in_features = in_features
        self.out_features = out_features
        self.local_out = divide(out_features, tp.size, "output features")
        self.cols = Span.whole(in_features)
        self._make_weights(self.local_out, in_features, bias, quant)

    def rows(self, shard_id: object) -> Span:
        rank = tp_group().rank
        return Span(rank * self.local_out, 0, self.local_out, self.out_features, self.local_out)


class MergedColumnParallelLinear(ShardedLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate and up).

    The local weight is ``[rank's slice of part 0; rank's slice of part 1; ...]``, so a forward yields
    each part's local slice back to back.
    """

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False, quant=None):
        super().__init__()
        tp = tp_group()
        self.in_features = in_features
        self.part_sizes = list(part_sizes)
        self.local_parts = [divide(s, tp.size, "output features") for s in part_sizes]
        self.cols = Span.whole(in_features)
        self._make_weights(sum(self.local_parts), in_features, bias, quant)

    def rows(self, shard_id: object) -> Span:
        part = int(shard_id)  # type: ignore[arg-type]
        local = self.local_parts[part]
        return Span(tp_group().rank * local, sum(self.local_parts[:part]), local, self.part_sizes[part],
                    sum(self.local_parts))

    def row_spans(self) -> list[Span]:
        return [self.rows(i) for i in range(len(self.part_sizes))]


class QKVParallelLinear(ShardedLinear):
    """Fused q/k/v projection split by attention heads.

    Query heads are divided among ranks. Key/value heads are divided too when there are at least as
    many as ranks; otherwise each kv head is replicated on the ranks whose query heads use it (GQA
    with tp > num_kv_heads).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 quant=None):
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
        self.cols = Span.whole(hidden_size)
        self._make_weights(self.q_size + 2 * self.kv_size, hidden_size, bias, quant)

    def rows(self, shard_id: object) -> Span:
        local = self.q_size + 2 * self.kv_size
        if shard_id == "q":
            return Span(tp_group().rank * self.q_size, 0, self.q_size, self.num_heads * self.head_dim, local)
        dst = self.q_size + (0 if shard_id == "k" else self.kv_size)
        return Span(self.kv_head_start * self.head_dim, dst, self.kv_size, self.num_kv_heads * self.head_dim, local)

    def row_spans(self) -> list[Span]:
        return [self.rows(s) for s in ("q", "k", "v")]


class RowParallelLinear(ShardedLinear):
    """y = x Wᵀ with W split by input columns; partial sums are all-reduced, then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant=None):
        super().__init__()
        tp = tp_group()
        self.in_features, self.out_features = in_features, out_features
        self.local_in = divide(in_features, tp.size, "input features")
        self.cols = Span(tp.rank * self.local_in, 0, self.local_in, in_features, self.local_in)
        self._make_weights(out_features, self.local_in, bias, quant)

    def rows(self, shard_id: object) -> Span:
        return Span.whole(self.out_features)

    def forward_normed(self, h, residual, norm):
        raise TypeError("a row-parallel linear reads a sharded input, never a layer's normalised one")

    def partial(self, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """This rank's share of ``x Wᵀ`` before the all-reduce (no bias), for callers that sum several
        shares and reduce once (the MoE layer); ``swiglu`` as in ``forward``."""
        return self._product(x, None, swiglu)

    def forward(self, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        y = all_reduce(self.partial(x, swiglu))
        return y + self.bias if self.bias is not None else y
