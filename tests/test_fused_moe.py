"""The fused MoE kernel (tandem/kernels/fused_moe.py) on the CPU under the Triton interpreter: the device-side
grouping by expert, then the MoE layer's fused path against its reference loop (tandem/layers/moe.py,
one expert at a time) with float, INT4 (packed by ``compressed-tensors``) and FP8 block-wise experts, on
tiny shapes: 8 experts top-2 (plain top-k) and a DeepSeek-like grouped routing (4 groups, 2 kept, top-3,
scaling 2.5). GPU versions at Kimi shapes: tests/gpu/test_quant_kernels_gpu.py.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit (import below)
pytest.importorskip("triton")

from helpers import moe_triton_route, norm_rel_err  # noqa: E402
from tandem.models.loader import default_dtype  # noqa: E402
from tandem.kernels.fused_moe import (  # noqa: E402
    ExpertWeights, MoeTiles, align_by_expert, align_by_expert_torch, fused_moe,
)
from tandem.kernels import fused_moe as fused_moe_module  # noqa: E402
from tandem.layers import moe as moe_module  # noqa: E402
from tandem.layers.moe import MoE  # noqa: E402
from tandem.configs.deepseek import MoeConfig as RoutingConfig  # noqa: E402
from tandem.configs.quantization import Fp8Block, Int4Group, QuantConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
PLAIN_TOPK = RoutingConfig(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                           first_k_dense_replace=0, moe_layer_freq=1, n_group=1, topk_group=1, norm_topk_prob=False,
                           routed_scaling_factor=1.0)
GROUPED = RoutingConfig(n_routed_experts=16, num_experts_per_tok=3, n_shared_experts=0, moe_intermediate_size=32,
                        first_k_dense_replace=0, moe_layer_freq=1, n_group=4, topk_group=2, norm_topk_prob=True,
                        routed_scaling_factor=2.5)
HIDDEN = 64



@pytest.mark.parametrize("align", [align_by_expert, align_by_expert_torch], ids=["triton", "torch"])
@pytest.mark.parametrize("tokens,top_k,experts,block_m",
                         [(1, 8, 384, 16), (5, 2, 8, 16), (40, 3, 4, 16), (9, 2, 8, 4), (300, 8, 16, 16)])
def test_align_by_expert_gives_each_slot_one_row_in_a_block_of_its_expert(align, tokens, top_k, experts, block_m):
    """(300 x 8 slots are past the one-program kernel's reach: the Triton entry point falls back to torch.)"""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    slots, block_expert = align(ids, experts, block_m)
    slots, block_expert, ids = slots.cpu(), block_expert.cpu(), ids.cpu()
    n = tokens * top_k
    assert slots.numel() == block_expert.numel() * block_m
    real = slots[slots < n].long()
    assert sorted(real.tolist()) == list(range(n))  # every slot exactly once
    row_block = (slots < n).nonzero().flatten() // block_m
    assert torch.equal(block_expert[row_block].long(), ids.flatten()[real])  # in a block of its own expert
    used = block_expert < experts
    assert used.sum() == sum(-(-int((ids == e).sum()) // block_m) for e in range(experts))  # no wasted block
    assert not used[used.sum():].any()  # the empty blocks come last
    assert all(torch.all(slots[b * block_m:(b + 1) * block_m][:-1] <= slots[b * block_m + 1:(b + 1) * block_m])
               for b in range(block_expert.numel()))  # slot order within a block, padding last


@pytest.mark.parametrize("with_add", [False, True], ids=["routed", "plus-shared"])
def test_fused_moe_matches_a_per_token_loop(with_add):
    """The kernel alone against the formula, token by token, in float32 (with a shared output added)."""
    g = torch.Generator().manual_seed(0)
    experts, inter, tokens, top_k = 8, 32, 6, 2
    w13 = torch.randn(experts, 2 * inter, HIDDEN, generator=g) * 0.1
    w2 = torch.randn(experts, HIDDEN, inter, generator=g) * 0.1
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    route = torch.rand(tokens, top_k, generator=g)
    add = torch.randn(tokens, HIDDEN, generator=g)
    y = fused_moe(x.to(DEVICE), ExpertWeights(w13.to(DEVICE)), ExpertWeights(w2.to(DEVICE)),
                  route.to(DEVICE), ids.to(DEVICE), MoeTiles(16, 16, 32, 4, 2),
                  add=add.to(DEVICE) if with_add else None).cpu()
    ref = add.clone() if with_add else torch.zeros(tokens, HIDDEN)
    for t in range(tokens):
        for j in range(top_k):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            ref[t] += route[t, j] * (w2[ids[t, j]] @ (F.silu(gate) * up))
    assert norm_rel_err(y, ref) < 1e-5


@pytest.mark.parametrize("route_kind", ["slots", "grouped"])
def test_fused_moe_joins_the_stream_of_add_before_reading_it(route_kind):
    """``add`` written only when ``join`` runs (as a side stream's output is complete only once joined): the result
    holds it, so the launch that reads it comes after the join, on both routes; ``join`` runs once."""
    g = torch.Generator().manual_seed(3)
    experts, inter, tokens, top_k = 8, 32, 2, 2
    w13 = ExpertWeights((torch.randn(experts, 2 * inter, HIDDEN, generator=g) * 0.1).to(DEVICE))
    w2 = ExpertWeights((torch.randn(experts, HIDDEN, inter, generator=g) * 0.1).to(DEVICE))
    x = torch.randn(tokens, HIDDEN, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    route = torch.rand(tokens, top_k, generator=g).to(DEVICE)
    shared = torch.randn(tokens, HIDDEN, generator=g).to(DEVICE)
    tiles = None if route_kind == "slots" else MoeTiles(16, 16, 32, 4, 2)
    add, joins = torch.zeros_like(shared), []
    y = fused_moe(x, w13, w2, route, ids, tiles, add=add, join=lambda: joins.append(add.copy_(shared)))
    want = fused_moe(x, w13, w2, route, ids, tiles, add=shared)
    assert len(joins) == 1 and torch.equal(y, want)


def test_fused_moe_refuses_mismatched_expert_shapes():
    w13, w2 = ExpertWeights(torch.zeros(4, 64, HIDDEN)), ExpertWeights(torch.zeros(4, HIDDEN, 16))
    x, ids, route = torch.zeros(2, HIDDEN), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)
    with pytest.raises(ValueError, match=r"down has a tensor of shape \(4, 64, 16\), expected \(4, 64, 32\)"):
        fused_moe(x.to(DEVICE), w13, w2, route, ids)
    packed = ExpertWeights(torch.zeros(4, 64, HIDDEN // 8, dtype=torch.int32), torch.zeros(4, 64, 1), (1, 32))
    with pytest.raises(ValueError, match=r"gate_up has a tensor of shape \(4, 64, 1\), expected \(4, 64, 2\)"):
        fused_moe(x.to(DEVICE), packed, ExpertWeights(torch.zeros(4, HIDDEN, 32)), route, ids)


def fill_experts(moe: MoE, method: str, seed: int) -> None:
    """Random expert weights loaded through each expert's own checkpoint names, as the loader does;
    INT4 packed by compressed-tensors, FP8 quantized as the published format says."""
    from quantized_checkpoints import fp8_block_quantize, int4_compress

    g = torch.Generator().manual_seed(seed)
    shared = [moe.shared_experts] if moe.shared_experts is not None else []
    for expert in [*moe.experts, *shared]:
        for proj, parts in ((expert.gate_up_proj, 2), (expert.down_proj, 1)):
            for part in range(parts):
                rows = proj.local_parts[part] if parts == 2 else proj.out_features
                cols = proj.in_features
                w = torch.randn(rows, cols, generator=g) * 0.1
                shard = part if parts == 2 else None
                if method == "int4":
                    packed, _ = int4_compress(w.bfloat16(), 32)
                    proj.load_weight("weight_packed", packed["weight_packed"], shard)
                    proj.load_weight("weight_scale", packed["weight_scale"], shard)
                elif method == "fp8":
                    q, scale_inv, _ = fp8_block_quantize(w, (16, 32))
                    proj.load_weight("weight", q, shard)
                    proj.load_weight("weight_scale_inv", scale_inv, shard)
                else:
                    proj.load_weight("weight", w, shard)
    moe.gate.weight.data.copy_(torch.randn(moe.gate.weight.shape, generator=g))
    moe.gate.e_score_correction_bias.data.copy_(torch.randn(moe.gate.e_score_correction_bias.shape, generator=g) * 0.1)


def build_moe(cfg: RoutingConfig, method: str, dtype: torch.dtype, seed: int) -> MoE:
    quant = {"plain": None, "int4": QuantConfig("compressed-tensors", Int4Group(32)),
             "fp8": QuantConfig("fp8", Fp8Block((16, 32)))}[method]
    with torch.device(DEVICE), default_dtype(dtype):  # as the model runner builds it
        moe = MoE(HIDDEN, cfg, quant, "model.layers.1.mlp.")
    fill_experts(moe, method, seed)
    return moe


@pytest.mark.parametrize("method", ["plain", "int4", "fp8"])
@pytest.mark.parametrize("routing", [PLAIN_TOPK, GROUPED], ids=["top2-of-8", "grouped-top3-of-16"])
@pytest.mark.parametrize("tokens", [1, 4, 33])
def test_fused_path_matches_the_reference_loop(method, routing, tokens):
    moe = build_moe(routing, method, torch.float32, seed=tokens)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(50 + tokens)).to(DEVICE)
    weights, ids = moe.gate(x)
    assert norm_rel_err(moe.routed_fused(x, weights, ids), moe.routed_reference(x, weights, ids)) < 1e-5


@pytest.mark.parametrize("method", ["plain", "int4"])
def test_fused_path_in_bf16_and_through_forward(method, monkeypatch):
    """bf16 activations (and bf16 float experts), and ``forward`` taking the fused route when the
    Triton path is on (forced both ways here: on the GPU ``use_triton`` says so), shared expert included. The
    interpreter truncates float32 to bf16 where the GPU rounds to nearest: a looser bound here."""
    moe = build_moe(PLAIN_TOPK, method, torch.bfloat16, seed=7)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(8)).to(DEVICE, torch.bfloat16)
    if method == "plain":
        assert moe.experts[0].gate_up_proj.weight.dtype == torch.bfloat16
    moe_triton_route(monkeypatch, False)
    ref = moe(x)
    moe_triton_route(monkeypatch, True)
    fused = moe(x)
    assert fused.dtype == torch.bfloat16 and norm_rel_err(fused, ref) < 2e-2


def test_experts_are_views_of_the_stacks_and_restack_after_a_move():
    moe = build_moe(PLAIN_TOPK, "int4", torch.float32, seed=3)
    gate_up, down = moe.expert_weights()
    assert gate_up.weight.data_ptr() == moe.experts[0].gate_up_proj.weight_packed.data_ptr()
    assert down.scale[5].data_ptr() == moe.experts[5].down_proj.weight_scale.data_ptr()
    for e in moe.experts:  # what Module.to() does: new storage for every parameter
        for p in e.parameters():
            p.data = p.data.clone()
    gate_up, _ = moe.expert_weights()
    assert gate_up.weight.data_ptr() == moe.experts[0].gate_up_proj.weight_packed.data_ptr()
    assert torch.equal(gate_up.weight[3], moe.experts[3].gate_up_proj.weight_packed)


SHARED_TWO = RoutingConfig(n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=32,
                           first_k_dense_replace=0, moe_layer_freq=1, n_group=1, topk_group=1, norm_topk_prob=True,
                           routed_scaling_factor=2.5)


@pytest.fixture
def shared_as_slots(monkeypatch):
    """The shared experts as routing slots (off by default: apart, on the side stream; tandem/layers/moe.py)."""
    monkeypatch.setattr(moe_module, "SHARED_AS_SLOTS", True)


def test_shared_experts_run_apart_by_default():
    moe = build_moe(SHARED_TWO, "plain", torch.float32, seed=4)
    moe.weights_loaded()
    assert moe.shared_pieces == 0 and not moe.shared_slots_ready
    assert moe.expert_weights()[0].weight.shape[0] == SHARED_TWO.n_routed_experts  # no copies stacked behind them


@pytest.mark.parametrize("method", ["plain", "int4", "fp8"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_shared_experts_as_slots_equal_the_reference(method, tokens, monkeypatch, shared_as_slots):
    """Two shared experts cut into two pieces stacked behind the routed ones once the weights are in: a decode step
    routes each token to its top 3 and the two pieces (weight 1) in the same slot launches — no shared GEMVs of
    their own — and equals the reference (routed loop plus the shared MLP) on the same weights."""
    moe = build_moe(SHARED_TWO, method, torch.float32, seed=11 + tokens)
    assert moe.shared_pieces == 2 and not moe.shared_slots_ready
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(60 + tokens)).to(DEVICE)
    moe_triton_route(monkeypatch, False)
    ref = moe(x)
    moe.weights_loaded()
    routed = []
    real = fused_moe_module.routed_by_slots
    monkeypatch.setattr(fused_moe_module, "routed_by_slots", lambda *a, **k: routed.append(a[4].cpu()) or real(*a, **k))
    shared_calls = []
    monkeypatch.setattr(moe.shared_experts, "partial", lambda *a: shared_calls.append(1))
    moe_triton_route(monkeypatch, True)
    got = moe(x)
    assert shared_calls == [] and len(routed) == 1
    assert routed[0].shape == (tokens, 5) and (routed[0][:, 3:] == torch.tensor([8, 9])).all()
    assert norm_rel_err(got, ref) < 1e-5


def test_shared_experts_stay_apart_where_they_are_not_stored_as_the_routed_ones(shared_as_slots):
    """Kimi-K2.5's layout (INT4 routed experts, the shared expert in bf16: ``ignore``d by the quantization config),
    and a shared MLP whose width is no multiple of a routed expert's: no pieces, the shared MLP runs on its own."""
    kimi = QuantConfig("compressed-tensors", Int4Group(32), ignore=("re:.*shared_experts.*",))
    with torch.device(DEVICE):
        moe = MoE(HIDDEN, SHARED_TWO, kimi, "model.layers.1.mlp.")
    assert moe.experts[0].gate_up_proj.quant is not None and moe.shared_experts.gate_up_proj.quant is None
    assert moe.shared_pieces == 0
    with torch.device(DEVICE):
        moe = MoE(HIDDEN, dataclasses.replace(SHARED_TWO, n_shared_experts=1), None, "model.layers.1.mlp.")
    assert moe.shared_pieces == 1  # one shared expert of the routed width: one piece
    moe.shared_experts.down_proj.weight.data = torch.zeros(HIDDEN, 48)  # (wider than a routed expert's 32)
    assert not moe._shared_stackable(1)


def test_the_pieces_follow_a_restack_after_a_move(shared_as_slots):
    moe = build_moe(SHARED_TWO, "plain", torch.float32, seed=5)
    moe.weights_loaded()
    for p in moe.parameters():  # what Module.to() does: new storage for every parameter
        p.data = p.data.clone()
    gate_up, down = moe.expert_weights()
    shared_gate, shared_up = moe.shared_experts.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate_up.weight[9], torch.cat([shared_gate[32:], shared_up[32:]]))
    assert torch.equal(down.weight[8], moe.shared_experts.down_proj.weight[:, :32])
