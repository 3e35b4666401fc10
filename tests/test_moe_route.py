"""The fused noaux_tc routing kernel (tandem/kernels/moe_route.py) against tandem.layers.moe_router.noaux_tc_route
on the CPU under the Triton interpreter: one group and several, expert counts that are not powers of two
(Kimi's 384 are 3 × 128), biases that change the choice, with and without normalisation."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit (import below)
pytest.importorskip("triton")

from tandem.configs.deepseek import MoeConfig  # noqa: E402
from tandem.kernels.moe_route import noaux_route  # noqa: E402
from tandem.layers.moe_router import noaux_tc_route  # noqa: E402


@pytest.mark.parametrize("experts,n_group,topk_group,k,normalise", [
    (64, 1, 1, 6, True),  # DeepSeek-V2-Lite
    (48, 8, 3, 6, True),  # DeepSeek-V3's grouping, fewer experts (6 per group: padded to 8)
    (384, 1, 1, 8, True),  # Kimi-K2
    (24, 3, 2, 5, False),  # three groups (padded to 4)
])
def test_the_kernel_routes_as_the_reference(experts, n_group, topk_group, k, normalise):
    cfg = MoeConfig(n_routed_experts=experts, num_experts_per_tok=k, n_shared_experts=1, moe_intermediate_size=8,
                    first_k_dense_replace=0, moe_layer_freq=1, n_group=n_group, topk_group=topk_group,
                    norm_topk_prob=normalise, routed_scaling_factor=2.5)
    gen = torch.Generator().manual_seed(experts + k)
    logits = torch.randn(9, experts, generator=gen) * 3
    bias = torch.randn(experts, generator=gen) * 0.5  # large enough to change which experts win
    want_w, want_ids = noaux_tc_route(logits, bias, cfg)
    assert not torch.equal(want_ids, noaux_tc_route(logits, torch.zeros(experts), cfg)[1])  # the bias matters here
    got_w, got_ids = noaux_route(logits, bias, n_group, topk_group, k, normalise, 2.5)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("experts,n_group,topk_group,k", [
    (10, 3, 1, 2),  # groups do not divide the experts
    (12, 4, 1, 4),  # more experts wanted than the kept group holds
    (8, 8, 2, 2),  # one expert per group: a group scores its best two
    (8, 2, 3, 2),  # more groups kept than there are
])
def test_routing_that_does_not_fit_is_refused(experts, n_group, topk_group, k):
    with pytest.raises(ValueError, match="routing does not fit"):
        noaux_route(torch.zeros(2, experts), torch.zeros(experts), n_group, topk_group, k, True, 1.0)


def test_extra_slots_hold_the_experts_behind_the_routed_ones_at_weight_one():
    """``extra``: the shared experts' pieces stacked behind the routed experts (tandem.layers.moe), every token's."""
    cfg = MoeConfig(n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=8,
                    first_k_dense_replace=0, moe_layer_freq=1, n_group=1, topk_group=1, norm_topk_prob=True,
                    routed_scaling_factor=2.5)
    gen = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(5, 64, generator=gen) * 3, torch.randn(64, generator=gen) * 0.5
    want_w, want_ids = noaux_tc_route(logits, bias, cfg)
    got_w, got_ids = noaux_route(logits, bias, 1, 1, 6, True, 2.5, extra=2)
    assert got_ids.shape == (5, 8) and torch.equal(got_ids[:, :6], want_ids)
    assert torch.equal(got_ids[:, 6:], torch.tensor([[64, 65]] * 5))
    torch.testing.assert_close(got_w[:, :6], want_w, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_w[:, 6:], torch.ones(5, 2))
