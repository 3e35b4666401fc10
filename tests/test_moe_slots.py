"""The routed experts slot by slot (tandem/kernels/moe_slots.py) on the CPU under the Triton interpreter: the
decode route of the fused MoE for INT4 (packed by ``compressed-tensors``) and FP8 block-wise experts, against
the per-token formula on the dequantized weights, and against the grouped GEMM route on the same inputs."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit (import below)
pytest.importorskip("triton")

from helpers import norm_rel_err  # noqa: E402
from quantized_checkpoints import fp8_block_quantize, int4_compress  # noqa: E402
from tandem.kernels import fused_moe as fused_moe_module  # noqa: E402
from tandem.kernels.fused_moe import ExpertWeights, MoeTiles, fused_moe  # noqa: E402
from tandem.kernels.moe_slots import SLOTS_MAX  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
HIDDEN, INTER, EXPERTS = 64, 32, 4


def _quantized(w: torch.Tensor, method: str) -> tuple[ExpertWeights, torch.Tensor]:
    """Stacked experts ``w [E, N, K]`` in ``method``'s checkpoint format, and the weights they dequantize to."""
    if method == "int4":
        packed = [int4_compress(e.bfloat16(), 32) for e in w]  # (packed tensors, dequantized)
        weight = torch.stack([p["weight_packed"] for p, _ in packed])
        scale = torch.stack([p["weight_scale"] for p, _ in packed]).float()
        deq = torch.stack([d for _, d in packed]).float()
        return ExpertWeights(weight.to(DEVICE), scale.to(DEVICE), (1, 32)), deq
    q = [fp8_block_quantize(e, (16, 32)) for e in w]
    weight = torch.stack([t for t, _, _ in q])
    scale = torch.stack([s for _, s, _ in q]).float()
    deq = torch.stack([d for _, _, d in q]).float()
    return ExpertWeights(weight.to(DEVICE), scale.to(DEVICE), (16, 32)), deq


@pytest.mark.parametrize("method", ["int4", "fp8"])
@pytest.mark.parametrize("tokens,top_k", [(1, 3), (5, 2)])
def test_slots_route_matches_the_formula_and_the_grouped_route(method, tokens, top_k, monkeypatch):
    """Five tokens on four experts: slots share experts (each then reads its weight again)."""
    g = torch.Generator().manual_seed(tokens * 10 + top_k)
    gate_up, w13 = _quantized(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.1, method)
    down, w2 = _quantized(torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.1, method)
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:top_k] for _ in range(tokens)])
    route = torch.rand(tokens, top_k, generator=g)
    add = torch.randn(tokens, HIDDEN, generator=g)
    taken = []
    real = fused_moe_module.routed_by_slots
    monkeypatch.setattr(fused_moe_module, "routed_by_slots", lambda *a, **k: taken.append(1) or real(*a, **k))
    args = (x.to(DEVICE), gate_up, down, route.to(DEVICE), ids.to(DEVICE))
    by_slots = fused_moe(*args, add=add.to(DEVICE)).cpu()
    grouped = fused_moe(*args, MoeTiles(16, 16, 32, 4, 2), add=add.to(DEVICE)).cpu()
    assert taken == [1]  # the default took the slots route, the explicit tiles the grouped GEMM
    ref = add.clone()
    for t in range(tokens):
        for j in range(top_k):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            ref[t] += route[t, j] * (w2[ids[t, j]] @ (F.silu(gate) * up))
    assert norm_rel_err(by_slots, ref) < 1e-5
    assert norm_rel_err(by_slots, grouped) < 1e-5


def test_more_slots_than_the_limit_take_the_grouped_route(monkeypatch):
    g = torch.Generator().manual_seed(1)
    gate_up, _ = _quantized(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.1, "int4")
    down, _ = _quantized(torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.1, "int4")
    tokens = SLOTS_MAX // 2 + 1
    ids = torch.randint(0, EXPERTS, (tokens, 2), generator=g)
    monkeypatch.setattr(fused_moe_module, "routed_by_slots", lambda *a, **k: pytest.fail("took the slots route"))
    y = fused_moe(torch.randn(tokens, HIDDEN, generator=g).to(DEVICE), gate_up, down, torch.rand(tokens, 2).to(DEVICE),
                  ids.to(DEVICE))
    assert y.shape == (tokens, HIDDEN)
