"""The DeepSeek layers' fused kernels on a real GPU in bf16, against the torch route's own pieces on the same
GPU: the MLA prologue (tandem/kernels/mla_prologue.py) against RMSNorm, YarnRotary and the torch latent store —
the rotary bit for bit, the norm within a rounding (its reduction order differs) —, the routing kernel
(tandem/kernels/moe_route.py) against noaux_tc_route at V2-Lite's, V3's and Kimi's expert counts, and the fused
MoE's shared add against the sum without it plus a torch add, bit for bit, and the absorbed projections
(tandem/kernels/mla_absorb.py) against the einsums, directly and replayed in a CUDA graph. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # before importing triton kernels: nothing here may run on the CPU
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from helpers import norm_rel_err  # noqa: E402
from tandem.attention.metadata import AttentionMetadata  # noqa: E402
from tandem.attention.mla_torch_backend import TorchMLABackend  # noqa: E402
from tandem.configs.deepseek import MlaConfig, MoeConfig, YarnConfig  # noqa: E402
from tandem.kernels.fused_moe import ExpertWeights, fused_moe  # noqa: E402
from tandem.kernels.mla_absorb import absorb_out, absorb_q  # noqa: E402
from tandem.kernels.mla_prologue import mla_prologue  # noqa: E402
from tandem.kernels.moe_route import noaux_route  # noqa: E402
from tandem.layers.moe_router import noaux_tc_route  # noqa: E402
from tandem.layers.norm import RMSNorm  # noqa: E402
from tandem.layers.yarn_rotary import YarnRotary  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.mark.parametrize("heads,tokens", [(16, 1), (64, 7), (8, 64)])
def test_the_prologue_equals_the_torch_route_in_bf16(heads, tokens):
    m = MlaConfig(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  rope_theta=10000.0, rope_interleave=True, attention_bias=False,
                  yarn=YarnConfig(factor=32.0, original_max_position_embeddings=4096, attention_factor=1.3))
    g = torch.Generator(device=DEVICE).manual_seed(heads)
    rotary = YarnRotary(m, 8192).to(DEVICE)
    norm = RMSNorm(m.kv_lora_rank, 1e-6).to(DEVICE, torch.bfloat16)
    norm.weight.data = (torch.rand(m.kv_lora_rank, generator=g, device=DEVICE) + 0.5).bfloat16()
    q = torch.randn(tokens, heads, m.qk_head_dim, generator=g, device=DEVICE).bfloat16()
    kv_a = torch.randn(tokens, m.cache_dim, generator=g, device=DEVICE).bfloat16()
    positions = torch.randint(0, 8192, (tokens,), generator=g, device=DEVICE)
    slots = torch.randperm(64 * 64, generator=g, device=DEVICE)[:tokens]
    q_nope, q_pe = q.split([128, 64], dim=-1)
    c_kv, k_pe = kv_a.split([512, 64], dim=-1)
    want_q = torch.cat([q_nope, rotary(positions, q_pe)], dim=-1)
    want_latent = torch.cat([norm._norm(c_kv), rotary(positions, k_pe)], dim=-1)
    pool = torch.zeros(64, 64, 1, m.cache_dim, dtype=torch.bfloat16, device=DEVICE)
    want_pool = pool.clone()
    meta = AttentionMetadata.__new__(AttentionMetadata)
    meta.slot_mapping = slots
    TorchMLABackend.store(want_latent, want_pool, meta)
    mla_prologue(q, kv_a, norm.weight, 1e-6, rotary.cos, rotary.sin, positions, pool, slots, True)
    assert torch.equal(q, want_q) and torch.equal(kv_a[:, 512:], want_latent[:, 512:])  # the rotary: bit for bit
    assert norm_rel_err(kv_a[:, :512], want_latent[:, :512]) < 4e-3  # the norm: within a rounding
    assert torch.equal(pool.view(-1, m.cache_dim)[slots], kv_a)


@pytest.mark.parametrize("experts,n_group,topk_group,k", [(64, 1, 1, 6), (256, 8, 4, 8), (384, 1, 1, 8)],
                         ids=["v2-lite", "v3", "kimi"])
def test_the_routing_kernel_equals_noaux_tc_route(experts, n_group, topk_group, k):
    cfg = MoeConfig(n_routed_experts=experts, num_experts_per_tok=k, n_shared_experts=1, moe_intermediate_size=8,
                    first_k_dense_replace=0, moe_layer_freq=1, n_group=n_group, topk_group=topk_group,
                    norm_topk_prob=True, routed_scaling_factor=2.5)
    g = torch.Generator(device=DEVICE).manual_seed(experts)
    logits = torch.randn(64, experts, generator=g, device=DEVICE) * 4
    bias = torch.randn(experts, generator=g, device=DEVICE) * 0.3
    want_w, want_ids = noaux_tc_route(logits, bias, cfg)
    got_w, got_ids = noaux_route(logits, bias, n_group, topk_group, k, True, 2.5)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("experts,hidden", [(64, 2048), (384, 7168)], ids=["v2-lite", "kimi"])
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_the_router_gemv_equals_the_float32_linear_and_routes_alike(experts, hidden, tokens):
    """The router's logits from the GEMV kernel against ``linear(x.float(), W)`` (TF32 off) and a float64
    reference; the experts they select are the same."""
    from tandem.kernels.gemv import router_logits

    g = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g, device=DEVICE).bfloat16()
    w = torch.randn(experts, hidden, generator=g, device=DEVICE) * 0.02
    got = router_logits(x, w)
    exact = torch.nn.functional.linear(x.double(), w.double())
    assert (got.double() - exact).abs().max() < 1e-5 * exact.abs().max()
    torch.testing.assert_close(got, torch.nn.functional.linear(x.float(), w), rtol=1e-5, atol=1e-5)
    bias = torch.randn(experts, generator=g, device=DEVICE) * 0.01
    assert torch.equal(noaux_route(got, bias, 1, 1, 8, True, 2.5)[1],
                       noaux_route(torch.nn.functional.linear(x.float(), w), bias, 1, 1, 8, True, 2.5)[1])


def test_the_shared_add_equals_a_torch_add_after_the_sum_in_bf16():
    g = torch.Generator(device=DEVICE).manual_seed(3)
    experts, hidden, inter, tokens, k = 64, 2048, 1408, 8, 6
    gate_up = ExpertWeights((torch.randn(experts, 2 * inter, hidden, generator=g, device=DEVICE) * 0.02).bfloat16())
    down = ExpertWeights((torch.randn(experts, hidden, inter, generator=g, device=DEVICE) * 0.02).bfloat16())
    x = torch.randn(tokens, hidden, generator=g, device=DEVICE).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=g, device=DEVICE)[:k] for _ in range(tokens)])
    route = torch.rand(tokens, k, generator=g, device=DEVICE)
    shared = torch.randn(tokens, hidden, generator=g, device=DEVICE).bfloat16()
    assert torch.equal(fused_moe(x, gate_up, down, route, ids, add=shared), fused_moe(x, gate_up, down, route, ids) + shared)


@pytest.mark.parametrize("tokens", [1, 8])
def test_the_absorbed_projections_equal_the_einsums_in_bf16_and_in_a_graph(tokens):
    """V2-Lite's shapes: 16 heads, nope 128, rope 64, kv_lora 512, v 128; W_UK and W_UV views of one kv_b
    weight and q a view of a wider projection output, as MLAttention passes them. Against the float32
    einsums within a bf16 rounding (the summation order differs from cuBLAS'), the rope dims bit for bit."""
    heads, nope, rope, kv_lora, v = 16, 128, 64, 512, 128
    g = torch.Generator(device=DEVICE).manual_seed(tokens)
    kv_b = (torch.randn(heads * (nope + v), kv_lora, generator=g, device=DEVICE) * 0.05).bfloat16()
    w_uk, w_uv = kv_b.view(heads, nope + v, kv_lora).split([nope, v], 1)
    q = torch.randn(tokens, heads * (nope + rope) + 8, generator=g, device=DEVICE).bfloat16()
    q = q[:, 8:].view(tokens, heads, nope + rope)
    attended = torch.randn(tokens, heads, kv_lora, generator=g, device=DEVICE).bfloat16()

    def reference(q, attended):
        q_latent = torch.einsum("thn,hnc->thc", q[..., :nope].float(), w_uk.float())
        return q_latent, torch.einsum("thc,hvc->thv", attended.float(), w_uv.float())

    def check(got_q, got_out, q, attended):
        want_q, want_out = reference(q, attended)
        torch.testing.assert_close(got_q[..., :kv_lora].float(), want_q, rtol=2 ** -8, atol=1e-3)
        torch.testing.assert_close(got_out.float(), want_out, rtol=2 ** -8, atol=1e-3)
        assert torch.equal(got_q[..., kv_lora:], q[..., nope:])

    check(absorb_q(q, w_uk, kv_lora), absorb_out(attended, w_uv), q, attended)

    side = torch.cuda.Stream()  # warm up (compile) off the capturing stream, as graph capture wants
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        absorb_out(attended, w_uv), absorb_q(q, w_uk, kv_lora)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_q, got_out = absorb_q(q, w_uk, kv_lora), absorb_out(attended, w_uv)
    q.copy_(torch.randn(q.shape, generator=g, device=DEVICE))  # new inputs in the captured buffers
    attended.copy_(torch.randn(attended.shape, generator=g, device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    check(got_q, got_out, q, attended)
