"""Quantized weight formats for the linear layers (and, next, MoE experts): packed tensors kept as the
checkpoint stores them, sharded along whole blocks/groups, dequantized per call by the reference path.

A format is attached to a layer of tandem/layers/linear.py as ``quant`` (``make_format``). It
registers its tensors on the layer under their checkpoint names (so the loader finds and expects
them), loads each through the layer's row/column ``Span``s scaled to the tensor's units, and computes
``x Wᵀ + b`` (``apply``) — W is never held dequantized. On the GPU ``apply`` runs the W4A16 / W8A16
Triton kernels (tandem/kernels/dequant_gemm.py), which dequantize tiles of this very layout in
registers; on the CPU it dequantizes this rank's weight for the call (float32 products, rounded to the
activation dtype), the reference the kernels are tested against. The layout and the ``dequantize_*``
functions take any leading dims (a stack of experts, tandem/layers/moe.py); a layer
using a format provides ``row_spans()`` and ``cols`` (``Span``s, as the linear layers do); a stack of
experts passes ``leading=(num_experts,)`` to ``create`` and ``expert=e`` to ``load``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed import tp_group
from tandem.errors import ConfigError
from tandem.layers.activation import silu_mul
from tandem.layers.fast_path import use_triton
from tandem.layers.linear import ShapeMismatch, Span, check_shape
from tandem.configs.quantization import Fp8Block, Int4Group, QuantConfig

NIBBLE_SHIFTS = tuple(range(0, 32, 4))  # eight int4 per int32, low nibble first


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., N, K]`` e4m3 and ``[..., ceil(N/bn), ceil(K/bk)]`` scales → ``W = w * scale_inv`` (edge
    blocks cover what is left)."""
    n, k = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(block[1], -1)[..., :k]
    return (weight.float() * scale).to(dtype)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """``[..., N, ceil(K/8)]`` int32 → ``[..., N, K]`` int8 in [-8, 7] (stored as q + 8)."""
    shifts = torch.tensor(NIBBLE_SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift; the mask drops the sign bits
    return (nibbles.flatten(-2)[..., :cols] - 8).to(torch.int8)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, cols: int, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W = (nibble - 8) * scale``, one scale per ``group_size`` columns of a row."""
    scale = scale.float().repeat_interleave(group_size, -1)[..., :cols]
    return (unpack_int4(packed, cols).float() * scale).to(dtype)


@dataclass(frozen=True)
class Packed:
    """One checkpoint tensor of a format: its dtype here and how many weight rows/columns one entry covers."""

    dtype: torch.dtype
    row_unit: int
    col_unit: int
    what: str  # names the unit in an alignment error


class DtypeMismatch(ShapeMismatch):
    def __init__(self, got: torch.dtype, expected: torch.dtype):
        ValueError.__init__(self, f"has dtype {got}, expected {expected}")


class ShapeRecordMismatch(ShapeMismatch):
    def __init__(self, got: tuple[int, ...], expected: tuple[int, ...]):
        ValueError.__init__(self, f"records weight shape {tuple(got)}, expected {expected}")


class QuantFormat:
    """Base of the formats: one instance per layer (``name`` is its checkpoint module, for messages)."""

    tensors: dict[str, Packed] = {}

    def __init__(self, name: str):
        self.name = name
        self.shape = (0, 0)  # this rank's (out, in)

    def create(self, layer: nn.Module, out_local: int, in_local: int, leading: tuple[int, ...] = ()) -> None:
        """Register this format's tensors on ``layer`` for a local ``[*leading, out, in]`` weight, after
        checking that every row piece (fused parts, rank slices) and the column slice keep whole units."""
        self.shape = (out_local, in_local)
        for spec in self.tensors.values():
            for span in layer.row_spans():
                self._check_aligned(span, spec.row_unit, "rows", spec.what)
            self._check_aligned(layer.cols, spec.col_unit, "input columns", spec.what)
            size = (*leading, cdiv(out_local, spec.row_unit), cdiv(in_local, spec.col_unit))
            name = next(n for n, s in self.tensors.items() if s is spec)
            layer.register_parameter(name, nn.Parameter(torch.zeros(size, dtype=spec.dtype), requires_grad=False))

    def _check_aligned(self, span: Span, unit: int, dim: str, what: str) -> None:
        tail = span.src + span.length == span.full and span.dst + span.length == span.local
        if span.src % unit == 0 and span.dst % unit == 0 and (span.length % unit == 0 or tail):
            return
        tp = tp_group().size
        fix = (f"choose a tensor-parallel size (now {tp}) that keeps whole {what}s" if tp > 1 else
               f"the parts fused into this projection must each hold whole {what}s, and this checkpoint's do not "
               f"(their {dim} are not a multiple of {unit}): not supported")
        raise ConfigError(
            f"{self.name}: this rank's {dim} {span.src}..{span.src + span.length} of {span.full} (placed at "
            f"{span.dst} of {span.local}) would split a {what} ({unit} {dim} each); {fix}"
        )

    def load(self, layer: nn.Module, param: str, tensor: torch.Tensor, rows: Span, cols: Span,
             expert: int | None = None) -> None:
        if param == "weight_shape":  # a record of the unpacked shape, checked and dropped
            if tuple(int(v) for v in tensor.flatten()) != (rows.full, cols.full):
                raise ShapeRecordMismatch(tuple(int(v) for v in tensor.flatten()), (rows.full, cols.full))
            return
        spec = self.tensors[param]
        check_shape(tensor, (cdiv(rows.full, spec.row_unit), cdiv(cols.full, spec.col_unit)))
        if tensor.dtype != spec.dtype and not _held_exactly(tensor, spec.dtype):
            raise DtypeMismatch(tensor.dtype, spec.dtype)
        target = getattr(layer, param).data
        target = target[expert] if expert is not None else target
        dst, src = _scaled(rows, spec.row_unit).copy(target, tensor, 0)
        dst, src = _scaled(cols, spec.col_unit).copy(dst, src, 1)
        dst.copy_(src)

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, swiglu: bool = False) -> torch.Tensor:
        """The float reference: this rank's W dequantized for this call only. ``swiglu``: x is [gate | up], the
        product is with silu(gate) * up."""
        return F.linear(silu_mul(x) if swiglu else x, self.dequantize(layer, x.dtype), bias)


class Fp8BlockFormat(QuantFormat):
    def __init__(self, name: str, scheme: Fp8Block):
        super().__init__(name)
        self.block = scheme.block
        bn, bk = scheme.block
        self.tensors = {
            "weight": Packed(torch.float8_e4m3fn, 1, 1, "fp8 weight"),
            "weight_scale_inv": Packed(torch.float32, bn, bk, f"{bn}x{bk} fp8 block"),
        }

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_block(layer.weight, layer.weight_scale_inv, self.block, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, swiglu: bool = False) -> torch.Tensor:
        if use_triton(x):
            from tandem.kernels.dequant_gemm import fp8_block_linear

            return fp8_block_linear(x, layer.weight, layer.weight_scale_inv, self.block, bias, swiglu=swiglu)
        return super().apply(layer, x, bias, swiglu)


class Int4GroupFormat(QuantFormat):
    def __init__(self, name: str, scheme: Int4Group):
        super().__init__(name)
        self.group_size = g = scheme.group_size
        self.tensors = {
            "weight_packed": Packed(torch.int32, 1, 8, "int32 word of 8 int4"),
            "weight_scale": Packed(getattr(torch, scheme.held_scale_dtype), 1, g, f"{g}-column int4 group"),
        }

    def create(self, layer: nn.Module, out_local: int, in_local: int, leading: tuple[int, ...] = ()) -> None:
        super().create(layer, out_local, in_local, leading)
        # weight_shape [2] per checkpoint part: the loader expects it; load checks its value
        layer.register_parameter("weight_shape", nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(layer.weight_packed, layer.weight_scale, self.shape[1], self.group_size, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, swiglu: bool = False) -> torch.Tensor:
        if use_triton(x):
            from tandem.kernels.dequant_gemm import int4_linear

            return int4_linear(x, layer.weight_packed, layer.weight_scale, self.group_size, bias, swiglu=swiglu)
        return super().apply(layer, x, bias, swiglu)


def _held_exactly(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether scales stored in another float dtype than the one held (a checkpoint mixing them) convert exactly."""
    if not (tensor.dtype.is_floating_point and dtype.is_floating_point) or 1 in (tensor.dtype.itemsize, dtype.itemsize):
        return False
    return bool(torch.equal(tensor.to(dtype).to(tensor.dtype), tensor))


def _scaled(span: Span, unit: int) -> Span:
    """``span`` in units of ``unit`` weight entries (alignment checked when the layer was built)."""
    if unit == 1:
        return span
    start = span.src // unit
    return Span(start, span.dst // unit, cdiv(span.src + span.length, unit) - start, cdiv(span.full, unit),
                cdiv(span.local, unit))


def linear_format(quant: QuantConfig | None, prefix: str, parts: tuple[str, ...]) -> QuantFormat | None:
    """The format of the linear fusing checkpoint modules ``prefix + part`` (None: unquantized)."""
    scheme = quant.scheme_for([prefix + p for p in parts]) if quant is not None else None
    if scheme is None:
        return None
    name = prefix + "+".join(parts)
    return Fp8BlockFormat(name, scheme) if isinstance(scheme, Fp8Block) else Int4GroupFormat(name, scheme)
