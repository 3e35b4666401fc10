"""The routed experts slot by slot (tandem/kernels/moe_slots.py) on the CPU under the Triton interpreter: the
decode route of the fused MoE for INT4 (packed by ``compressed-tensors``) and FP8 block-wise experts, against
the per-token formula on the dequantized weights, and against the grouped GEMM route on the same inputs; plain
(bf16, fp16, fp32) experts against per-slot ``F.linear`` (with the kernels' roundings, and in float64)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit (import below)
pytest.importorskip("triton")

from helpers import moe_triton_route, norm_rel_err  # noqa: E402
from quantized_checkpoints import fp8_block_quantize, int4_compress  # noqa: E402
from tandem.kernels import fused_moe as fused_moe_module  # noqa: E402
from tandem.kernels import moe_slots  # noqa: E402
from tandem.kernels.fused_moe import ExpertWeights, MoeTiles, fused_moe  # noqa: E402
from tandem.kernels.moe_slots import PLAIN_SLOTS_MAX, SLOTS_MAX, slots_apply  # noqa: E402

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


# ---------------------------------------------------------------- plain (bf16 / fp16 / fp32) experts
def _plain_reference(x, w13, w2, route, ids, add, dtype):
    """Per-slot ``F.linear`` with the documented rounding: gate and up rounded to ``dtype``, the silu rounded, the
    product rounded; each slot's down product rounded, weighted and summed in float32, rounded, then ``add``. (The
    down GEMV computes the activation itself, rounding to nearest as torch does also under the interpreter.)"""
    r = lambda t: _rounded(t, dtype)  # noqa: E731
    nearest = lambda t: t.to(dtype).float()  # noqa: E731
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = r(F.linear(r(x[t]), r(w13[ids[t, j]]))).chunk(2)
            act = nearest(nearest(F.silu(gate)) * up)
            out[t] += route[t, j] * r(F.linear(act, r(w2[ids[t, j]])))
    return (r(out) if add is None else r(r(out) + r(add))).to(dtype)


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype`` as the kernels round it, in float32: the GPU to nearest, the interpreter's float32
    to bf16 cast toward zero (it drops the low 16 bits)."""
    t = t.float()
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        return (t.view(torch.int32) & -65536).view(torch.float32)
    return t.to(dtype).float()


def _exact(x, w13, w2, route, ids, add):
    """The same sum in float64 with no rounding at all."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64) if add is None else add.double().clone()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = F.linear(x[t].double(), w13[ids[t, j]].double()).chunk(2)
            out[t] += route[t, j].double() * F.linear(F.silu(gate) * up, w2[ids[t, j]].double())
    return out


# (tokens, top_k, experts, hidden, inter, shared experts' add, repeated experts within a token's slots);
# inter 40 and hidden 96 leave a partial last K step (whole 16-byte words: 8 bf16 or 4 fp32 weights)
PLAIN_CASES = [(1, 2, 4, 64, 40, True, False), (1, 6, 16, 96, 32, False, False), (2, 8, 8, 64, 40, True, False),
               (2, 4, 6, 64, 24, False, True), (1, 8, 4, 96, 40, True, True)]


def _case_id(p) -> str:
    if isinstance(p, torch.dtype):
        return str(p).split(".")[-1]
    return "t{}k{}e{}h{}i{}{}{}".format(*p[:5], "-add" if p[5] else "", "-rep" if p[6] else "")


@pytest.mark.parametrize("dtype,case", [(dt, c) for dt in (torch.float32, torch.bfloat16) for c in PLAIN_CASES]
                         + [(torch.float16, PLAIN_CASES[2])], ids=_case_id)
def test_plain_slots_match_the_per_expert_reference_and_the_grouped_route(dtype, case, monkeypatch):
    tokens, top_k, experts, hidden, inter, with_add, repeat = case
    # the kernels whatever the tuned limit (the routing itself: the tests below)
    monkeypatch.setattr(moe_slots, "PLAIN_SLOTS_MAX", max(PLAIN_SLOTS_MAX, tokens * top_k))
    g = torch.Generator().manual_seed(tokens * 100 + top_k * 10 + experts)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    if repeat or top_k > experts:  # an expert twice in a token's slots (each slot reads its weight again)
        ids = torch.randint(0, experts, (tokens, top_k), generator=g)
        ids[:, 1] = ids[:, 0]
    else:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    route = torch.rand(tokens, top_k, generator=g)
    add = torch.randn(tokens, hidden, generator=g).to(dtype) if with_add else None
    taken = []
    real = fused_moe_module.routed_by_slots
    monkeypatch.setattr(fused_moe_module, "routed_by_slots", lambda *a, **k: taken.append(1) or real(*a, **k))
    gate_up, down = ExpertWeights(w13.to(DEVICE)), ExpertWeights(w2.to(DEVICE))
    args = (x.to(DEVICE), gate_up, down, route.to(DEVICE), ids.to(DEVICE))
    dev_add = add.to(DEVICE) if add is not None else None
    by_slots = fused_moe(*args, add=dev_add).cpu()
    grouped = fused_moe(*args, MoeTiles(16, 16, 32, 4, 2), add=dev_add).cpu()
    assert taken == [1] and by_slots.dtype == dtype  # the default took the slots, the explicit tiles the grouped GEMM
    exact = _exact(x, w13, w2, route, ids, add)
    if dtype == torch.float32:
        assert norm_rel_err(by_slots, exact) < 1e-6
        assert norm_rel_err(by_slots, grouped) < 1e-6
    else:  # the roundings of the reference: the summation order may move one by an ulp
        assert norm_rel_err(by_slots, _plain_reference(x, w13, w2, route, ids, add, dtype)) < 4e-3
        # (the interpreter's stores cast toward zero, the grouped kernel's in-register roundings to nearest)
        assert norm_rel_err(by_slots, grouped) < (4e-3 if DEVICE == "cuda" else 1.5e-2)
        assert norm_rel_err(by_slots, exact) < 3e-2  # bf16 cast toward zero under the interpreter: a biased error


def test_plain_experts_beyond_the_plain_limit_take_the_grouped_route(monkeypatch):
    g = torch.Generator().manual_seed(2)
    gate_up = ExpertWeights((torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.1).bfloat16().to(DEVICE))
    down = ExpertWeights((torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.1).bfloat16().to(DEVICE))
    assert PLAIN_SLOTS_MAX < SLOTS_MAX  # the quantized formats' limit does not apply to plain weights
    tokens = PLAIN_SLOTS_MAX // 2 + 1
    ids = torch.randint(0, EXPERTS, (tokens, 2), generator=g)
    monkeypatch.setattr(fused_moe_module, "routed_by_slots", lambda *a, **k: pytest.fail("took the slots route"))
    y = fused_moe(torch.randn(tokens, HIDDEN, generator=g).bfloat16().to(DEVICE), gate_up, down,
                  torch.rand(tokens, 2).to(DEVICE), ids.to(DEVICE))
    assert y.shape == (tokens, HIDDEN) and y.dtype == torch.bfloat16


def test_plain_slots_need_whole_16_byte_words():
    """A row of 36 weights is 9 words of fp32 but 4.5 of bf16: the bf16 experts take the grouped GEMM."""
    def experts(dtype, hidden):
        return (ExpertWeights(torch.empty(4, 2 * 8, hidden, dtype=dtype)),
                ExpertWeights(torch.empty(4, hidden, 8, dtype=dtype)))
    assert slots_apply(8, *experts(torch.float32, 36))
    assert not slots_apply(8, *experts(torch.bfloat16, 36))
    assert slots_apply(8, *experts(torch.bfloat16, 40)) and slots_apply(PLAIN_SLOTS_MAX, *experts(torch.float16, 40))
    assert not slots_apply(PLAIN_SLOTS_MAX + 1, *experts(torch.bfloat16, 40))
    assert not slots_apply(0, *experts(torch.bfloat16, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2])
def test_plain_moe_layer_at_decode_takes_the_slots_and_matches_its_reference(dtype, tokens, monkeypatch):
    """A DeepSeek MoE layer of plain experts (top-2 of 8, a shared expert: the fused route's ``add``) through
    ``forward`` with the Triton path forced on, against the layer's per-expert loop with it off."""
    from test_fused_moe import PLAIN_TOPK, build_moe

    moe = build_moe(PLAIN_TOPK, "plain", dtype, seed=11 + tokens)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(DEVICE, dtype)
    moe_triton_route(monkeypatch, False)
    ref = moe(x)
    taken = []
    real = fused_moe_module.routed_by_slots
    monkeypatch.setattr(fused_moe_module, "routed_by_slots", lambda *a, **k: taken.append(1) or real(*a, **k))
    moe_triton_route(monkeypatch, True)
    fused = moe(x)
    assert taken == [1] and fused.dtype == dtype
    # the reference rounds each expert's weighted share to the dtype, the kernels the sum (and the interpreter's
    # bf16 cast truncates): bf16 agrees to its rounding only
    assert norm_rel_err(fused, ref) < (1e-5 if dtype == torch.float32 else 3e-2)
