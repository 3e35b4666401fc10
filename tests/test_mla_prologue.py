"""The fused MLA prologue kernel (tandem/kernels/mla_prologue.py) against the reference path's own pieces —
RMSNorm, YarnRotary and the torch MLA backend's latent store — on the CPU under the Triton interpreter:
YaRN and plain rope, interleaved and halves, strided positions, scattered slots and a skipped one, pools with
and without the head axis, float32 and bf16 (the rotary bit for bit — its rounding is done on the bits,
tandem/kernels/rounding.py — the norm loosely, its rsqrt being the interpreter's). The engines on the kernel
route (with this prologue) against the torch route: tests/test_mla_kernel_route.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit (import below)
pytest.importorskip("triton")

from helpers import norm_rel_err  # noqa: E402
from tandem.attention.metadata import AttentionMetadata  # noqa: E402
from tandem.attention.mla_torch_backend import TorchMLABackend  # noqa: E402
from tandem.configs.deepseek import MlaConfig, YarnConfig  # noqa: E402
from tandem.kernels.mla_prologue import mla_prologue  # noqa: E402
from tandem.layers.norm import RMSNorm  # noqa: E402
from tandem.layers.yarn_rotary import YarnRotary  # noqa: E402


def _mla(interleave: bool, yarn: bool, rope: int = 16) -> MlaConfig:
    return MlaConfig(q_lora_rank=None, kv_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=rope, v_head_dim=20,
                     rope_theta=10000.0, rope_interleave=interleave,
                     yarn=YarnConfig(factor=4.0, original_max_position_embeddings=64, attention_factor=1.2) if yarn
                     else None, attention_bias=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave,yarn,head_axis", [(True, True, True), (False, False, False), (True, False, True)])
def test_the_prologue_equals_norm_rotary_and_store(dtype, interleave, yarn, head_axis):
    m, heads, tokens, page, pages = _mla(interleave, yarn), 5, 7, 4, 6
    gen = torch.Generator().manual_seed(int(interleave) * 2 + int(yarn))
    rotary = YarnRotary(m, max_positions=256)
    norm = RMSNorm(m.kv_lora_rank, 1e-6)
    norm.weight.data = torch.rand(m.kv_lora_rank, generator=gen) + 0.5
    norm = norm.to(dtype)
    q = torch.randn(tokens, heads, m.qk_head_dim, generator=gen).to(dtype)
    kv_a = torch.randn(tokens, m.cache_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 256, (tokens,), generator=gen)
    slots = torch.randperm(pages * page, generator=gen)[:tokens]
    # the reference: MLAttention.forward's pieces on the torch backend
    q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
    c_kv, k_pe = kv_a.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
    want_latent = torch.cat([norm(c_kv), rotary(positions, k_pe)], dim=-1)
    want_q = torch.cat([q_nope, rotary(positions, q_pe)], dim=-1)
    want_pool = torch.randn(pages, page, *((1,) if head_axis else ()), m.cache_dim, generator=gen).to(dtype)
    pool = want_pool.clone()
    meta = AttentionMetadata.__new__(AttentionMetadata)
    meta.slot_mapping = slots[1:]  # the first token is padding: no store
    TorchMLABackend.store(want_latent[1:], want_pool, meta)

    skip = slots.clone()
    skip[0] = -1
    mla_prologue(q, kv_a, norm.weight, 1e-6, rotary.cos, rotary.sin, positions, pool, skip, interleave)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert norm_rel_err(q, want_q) < tol and norm_rel_err(kv_a, want_latent) < tol
    rope = slice(m.kv_lora_rank, None)
    assert torch.equal(q, want_q) and torch.equal(kv_a[:, rope], want_latent[:, rope])  # the rotary: bit for bit
    flat, want_flat = pool.view(-1, m.cache_dim), want_pool.view(-1, m.cache_dim)
    assert norm_rel_err(flat[slots[1:]], want_latent[1:]) < tol  # the entries written
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[1:]] = False
    assert torch.equal(flat[untouched], want_flat[untouched])  # ... every other one as it was (the skipped slot's too)


def test_positions_and_slots_are_read_through_their_strides():
    m = _mla(True, True)
    rotary, weight = YarnRotary(m, 64), torch.ones(m.kv_lora_rank)
    q, kv_a = torch.randn(3, 2, m.qk_head_dim), torch.randn(3, m.cache_dim)
    positions = torch.tensor([9]).expand(3)  # one request's tree nodes share a position: stride 0
    slots = torch.tensor([[0, 100], [5, 100], [6, 100]])[:, 0]  # strided
    pool = torch.zeros(4, 4, 1, m.cache_dim)
    want_k = rotary(positions, kv_a[:, m.kv_lora_rank:].clone())
    mla_prologue(q, kv_a, weight, 1e-6, rotary.cos, rotary.sin, positions, pool, slots, True)
    assert torch.allclose(kv_a[:, m.kv_lora_rank:], want_k, atol=1e-6)
    assert torch.equal(pool.view(-1, m.cache_dim)[[0, 5, 6]], kv_a)


def test_shapes_that_do_not_agree_are_refused():
    m = _mla(True, False)
    rotary = YarnRotary(m, 16)
    q, kv_a = torch.randn(2, 3, m.qk_head_dim), torch.randn(2, m.cache_dim + 1)
    with pytest.raises(ValueError, match="MLA shapes do not agree"):
        mla_prologue(q, kv_a, torch.ones(m.kv_lora_rank), 1e-6, rotary.cos, rotary.sin, torch.zeros(2, dtype=torch.long),
                     torch.zeros(2, 4, 1, m.cache_dim), torch.zeros(2, dtype=torch.long), True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave,yarn,tokens", [(True, True, 1), (False, False, 7), (True, False, 3)])
def test_absorb_q_runs_the_prologue_in_its_launch_as_the_prologue_kernel_does(dtype, interleave, yarn, tokens):
    """absorb_q with a ``Prologue`` (one launch a layer, tandem/kernels/mla_absorb.py) against the reference pieces
    (norm, rotary, store, einsum) and bit for bit against the two launches it replaces; ``q`` is left unrotated."""
    from tandem.kernels.mla_absorb import absorb_q
    from tandem.kernels.mla_prologue import Prologue

    m, heads, page, pages = _mla(interleave, yarn), 5, 4, 6
    gen = torch.Generator().manual_seed(tokens + 10 * int(interleave))
    rotary = YarnRotary(m, max_positions=256)
    weight = (torch.rand(m.kv_lora_rank, generator=gen) + 0.5).to(dtype)
    w_uk = (torch.randn(heads, m.qk_nope_head_dim, m.kv_lora_rank, generator=gen) * 0.2).to(dtype)
    q = torch.randn(tokens, heads, m.qk_head_dim, generator=gen).to(dtype)
    kv_a = torch.randn(tokens, m.cache_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 256, (tokens,), generator=gen)
    slots = torch.randperm(pages * page, generator=gen)[:tokens]
    slots[0] = -1  # padding: no store
    pool = torch.randn(pages, page, 1, m.cache_dim, generator=gen).to(dtype)

    def run(fused: bool):
        q_in, kv_in, pool_in = q.clone(), kv_a.clone(), pool.clone()
        p = Prologue(kv_in, weight, 1e-6, rotary.cos, rotary.sin, positions, pool_in, slots, interleave)
        if fused:
            return absorb_q(q_in, w_uk, m.kv_lora_rank, p), q_in, kv_in, pool_in
        mla_prologue(q_in, *p)
        return absorb_q(q_in, w_uk, m.kv_lora_rank), q_in, kv_in, pool_in

    got, q_after, kv_got, pool_got = run(True)
    apart, _, kv_apart, pool_apart = run(False)
    assert torch.equal(q_after, q)  # the query's rope dims rotated on the way out only
    for a, b in ((got, apart), (kv_got, kv_apart), (pool_got, pool_apart)):
        assert torch.equal(a, b)
    # and the reference pieces
    q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
    c_kv, k_pe = kv_a.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
    norm = RMSNorm(m.kv_lora_rank, 1e-6).to(dtype)
    norm.weight.data = weight
    want_latent = torch.cat([norm(c_kv), rotary(positions, k_pe)], dim=-1)
    want_q = torch.cat([torch.einsum("thn,hnc->thc", q_nope.double(), w_uk.double()).to(dtype),
                        rotary(positions, q_pe)], -1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert norm_rel_err(got, want_q) < tol and norm_rel_err(kv_got, want_latent) < tol
    assert torch.equal(got[..., m.kv_lora_rank:], want_q[..., m.kv_lora_rank:])  # the rotary: bit for bit
    flat, before = pool_got.view(-1, m.cache_dim), pool.view(-1, m.cache_dim)
    assert norm_rel_err(flat[slots[1:]], want_latent[1:]) < tol
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[1:]] = False
    assert torch.equal(flat[untouched], before[untouched])
