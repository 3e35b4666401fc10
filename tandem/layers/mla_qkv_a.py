"""MLA's two projections of the layer input in one matmul (SGLang's ``fused_qkv_a_proj_with_mqa``): the
query's first one — ``q_proj`` (DeepSeek-V2 style, column-parallel by heads) or ``q_a_proj`` (replicated)
— and ``kv_a_proj_with_mqa`` (replicated: the latent and the rope key). At batch-1 decode each is a small,
launch-bound GEMV; one launch reads both weights.

The local weight is ``[this rank's q rows ; every kv_a row]``. The checkpoint keeps the two tensors; the
loader routes them here with shard ids ``"q"`` and ``"kv"`` (deepseek_v3.packed_weights). ``can_fuse``
says when the parts can share one weight: both unquantized, or both FP8 block-wise with the q part ending
on a block row (so their scale rows concatenate too); otherwise the model keeps the two linears.
"""

from __future__ import annotations

import torch

from tandem.distributed import divide, tp_group
from tandem.layers.linear import Span, ShardedLinear
from tandem.layers.quantized_linear import Fp8BlockFormat, QuantFormat


class QKVAProjection(ShardedLinear):
    """``x → (q, kv_a)``: one product, split by columns."""

    def __init__(self, in_features: int, q_size: int, kv_size: int, q_sharded: bool, bias: bool = False,
                 quant: QuantFormat | None = None):
        super().__init__()
        self.in_features, self.q_size, self.kv_size = in_features, q_size, kv_size
        self.q_local = q_local_rows(q_size, q_sharded)
        self.q_start = tp_group().rank * self.q_local if q_sharded else 0
        self.cols = Span.whole(in_features)
        self._make_weights(self.q_local + kv_size, in_features, bias, quant)  # reads row_spans(): last

    def rows(self, shard_id: object) -> Span:
        local = self.q_local + self.kv_size
        if shard_id == "q":
            return Span(self.q_start, 0, self.q_local, self.q_size, local)
        if shard_id == "kv":
            return Span(0, self.q_local, self.kv_size, self.kv_size, local)
        raise ValueError(f"QKVAProjection has parts 'q' and 'kv', not {shard_id!r}")

    def row_spans(self) -> list[Span]:
        return [self.rows("q"), self.rows("kv")]

    def _outputs(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [T, q_local], kv_a [T, kv])``: column views of one output, rows strided by its width (the
        consumers — views by head, norms, the prologue kernel writing in place — take any row stride)."""
        return y.split([self.q_local, self.kv_size], dim=-1)


def q_local_rows(q_size: int, q_sharded: bool) -> int:
    return divide(q_size, tp_group().size, "output features") if q_sharded else q_size


def can_fuse(q_format: QuantFormat | None, kv_format: QuantFormat | None, q_local: int) -> bool:
    """Whether the parts quantized as ``q_format`` and ``kv_format`` can share one weight."""
    if q_format is None and kv_format is None:
        return True
    if isinstance(q_format, Fp8BlockFormat) and isinstance(kv_format, Fp8BlockFormat):
        # a q part ending mid-block would share a scale with kv_a rows (INT4 and mixed formats stay apart too)
        return q_format.block == kv_format.block and q_local % q_format.block[0] == 0
    return False
