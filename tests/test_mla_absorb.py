"""The absorbed MLA projections (tandem/kernels/mla_absorb.py) against torch's einsums on the CPU under the
Triton interpreter: token counts 1, 3 and 16 (MAX_ROWS), several head counts, the query read through a
strided view and the weights as views of one kv_b weight, as MLAttention passes them.

float32 agrees to float32 rounding. bf16 is compared with the exact product (float64) rounded to bf16: the
kernel sums in float32 in its own order, cuBLAS (and torch's CPU bmm) in another, so either may land an ulp
away from the other; each is within an ulp of the exact result (plus the float32 sum's own error, which
matters only where the terms nearly cancel). The rope dims are a copy: bit for bit. The engines on this
route: tests/test_mla_kernel_route.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit (import below)
pytest.importorskip("triton")

from tandem.kernels.mla_absorb import MAX_ROWS, absorb_out, absorb_q  # noqa: E402

NOPE, ROPE, V = 16, 8, 24  # v ≠ nope: the split of kv_b's rows is asymmetric, as in Kimi's and V3's


def _weights(heads: int, kv_lora: int, dtype, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK [H, nope, kv_lora] and W_UV [H, v, kv_lora]: views of one kv_b weight [H·(nope + v), kv_lora]."""
    kv_b = (torch.randn(heads * (NOPE + V), kv_lora, generator=gen) * 0.2).to(dtype)
    return kv_b.view(heads, NOPE + V, kv_lora).split([NOPE, V], 1)


def _within_an_ulp(got: torch.Tensor, terms: torch.Tensor) -> None:
    """``got`` (bf16) against the exact sum of ``terms`` (float64, the last axis): within one bf16 ulp of it,
    plus the float32 accumulation's error bound."""
    exact = terms.sum(-1)
    _, exp = torch.frexp(exact.to(torch.bfloat16).double())
    ulp = torch.ldexp(torch.ones_like(exact), exp - 8).clamp_min(2.0 ** -133)  # 8 significant bits
    slack = terms.abs().sum(-1) * terms.shape[-1] * 2.0 ** -24
    assert ((got.double() - exact).abs() <= ulp + slack).all()


@pytest.mark.parametrize("tokens", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("heads,kv_lora", [(4, 32), (16, 64), (5, 64)])
def test_absorb_q_equals_the_einsum_and_the_concatenation_in_float32(tokens, heads, kv_lora):
    gen = torch.Generator().manual_seed(tokens * 100 + heads)
    w_uk, _ = _weights(heads, kv_lora, torch.float32, gen)
    q = torch.randn(tokens, heads, NOPE + ROPE, generator=gen)
    q_nope, q_pe = q.split([NOPE, ROPE], -1)
    want = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_uk), q_pe], -1)
    got = absorb_q(q, w_uk, kv_lora)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[..., kv_lora:], q_pe)


@pytest.mark.parametrize("tokens", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("heads,kv_lora", [(4, 32), (16, 64), (5, 64)])
def test_absorb_out_equals_the_einsum_in_float32(tokens, heads, kv_lora):
    gen = torch.Generator().manual_seed(tokens * 100 + heads + 1)
    _, w_uv = _weights(heads, kv_lora, torch.float32, gen)
    attended = torch.randn(tokens, heads, kv_lora, generator=gen)
    got = absorb_out(attended, w_uv)
    assert got.shape == (tokens, heads, V) and got.is_contiguous()
    torch.testing.assert_close(got, torch.einsum("thc,hvc->thv", attended, w_uv), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, MAX_ROWS])
def test_both_are_within_an_ulp_of_the_exact_product_in_bf16(tokens):
    heads, kv_lora, bf16 = 16, 64, torch.bfloat16
    gen = torch.Generator().manual_seed(tokens)
    w_uk, w_uv = _weights(heads, kv_lora, bf16, gen)
    q = torch.randn(tokens, heads, NOPE + ROPE, generator=gen).to(bf16)
    attended = torch.randn(tokens, heads, kv_lora, generator=gen).to(bf16)

    got_q = absorb_q(q, w_uk, kv_lora)
    assert got_q.dtype == bf16
    q_terms = q[..., :NOPE, None].double() * w_uk.double()  # [T, H, nope, kv_lora]
    _within_an_ulp(got_q[..., :kv_lora], q_terms.transpose(-1, -2))
    assert torch.equal(got_q[..., kv_lora:], q[..., NOPE:])

    got_out = absorb_out(attended, w_uv)
    _within_an_ulp(got_out, attended[:, :, None, :].double() * w_uv.double())  # [T, H, v, kv_lora]
    # and torch's own bf16 einsums, which round the same sums in another order: close, not bit-equal
    torch.testing.assert_close(got_q[..., :kv_lora], torch.einsum("thn,hnc->thc", q[..., :NOPE], w_uk),
                               rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got_out, torch.einsum("thc,hvc->thv", attended, w_uv), rtol=1.6e-2, atol=1e-2)


def test_the_query_is_read_through_its_strides():
    """MLAttention's q is a view of the q projection's output; here one with padded rows and heads."""
    heads, kv_lora, tokens = 4, 32, 3
    gen = torch.Generator().manual_seed(7)
    w_uk, w_uv = _weights(heads, kv_lora, torch.float32, gen)
    wide = torch.randn(tokens, heads + 2, NOPE + ROPE + 5, generator=gen)
    q = wide[:, 1:1 + heads, 2:2 + NOPE + ROPE]  # strides of the wide tensor, last one 1
    want = torch.cat([torch.einsum("thn,hnc->thc", q[..., :NOPE], w_uk), q[..., NOPE:]], -1)
    torch.testing.assert_close(absorb_q(q, w_uk, kv_lora), want, rtol=1e-5, atol=1e-5)
    big = torch.randn(tokens, heads, 2 * kv_lora, generator=gen)
    attended = big[..., kv_lora:]
    torch.testing.assert_close(absorb_out(attended, w_uv), torch.einsum("thc,hvc->thv", attended, w_uv),
                               rtol=1e-5, atol=1e-5)


def test_float16_and_shape_errors():
    heads, kv_lora = 4, 32
    gen = torch.Generator().manual_seed(3)
    w_uk, w_uv = _weights(heads, kv_lora, torch.float16, gen)
    q = torch.randn(2, heads, NOPE + ROPE, generator=gen).to(torch.float16)
    want = torch.einsum("thn,hnc->thc", q[..., :NOPE].float(), w_uk.float()).half()
    torch.testing.assert_close(absorb_q(q, w_uk, kv_lora)[..., :kv_lora], want, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="do not agree"):
        absorb_q(q, w_uk, kv_lora * 2)
    with pytest.raises(ValueError, match="differ"):
        absorb_out(torch.randn(2, heads, kv_lora), w_uv)
    assert absorb_out(torch.empty(0, heads, kv_lora, dtype=torch.float16), w_uv).shape == (0, heads, V)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,splits,per_head", [(1, 8, 4), (3, 2, 1), (MAX_ROWS, 4, 16)])
def test_absorb_out_merges_the_latent_attentions_splits_as_the_merge_kernel_does(tokens, splits, per_head, dtype,
                                                                                  monkeypatch):
    """Handed the latent attention's splits unmerged (LatentSplits), absorb_out merges each head's as it reads them:
    bit for bit what merge_splits then absorb_out give, splits that saw no key included (their outputs NaN, unread;
    a row no split saw is zero) — and the latent kernel hands its splits over only where it has several."""
    from tandem.kernels import mla_absorb
    from tandem.kernels.mla_attention import LatentSplits
    from tandem.kernels.paged_attention import merge_splits
    from tandem.kernels.pdl import pdl_launch

    monkeypatch.setattr(mla_absorb, "SPLIT_PROGRAMS_PER_HEAD", per_head)  # value rows cut into this many programs
    heads, kv_lora = 4, 64
    gen = torch.Generator().manual_seed(tokens * 10 + splits)
    _, w_uv = _weights(heads, kv_lora, dtype, gen)
    part_o = torch.randn(splits, tokens, heads, kv_lora, generator=gen)
    part_lse = torch.randn(splits, tokens, heads, generator=gen) * 4
    part_lse[-1], part_o[-1] = -1.0e30, float("nan")  # the last split saw no key anywhere ...
    part_lse[:, 0, 1], part_o[:, 0, 1] = -1.0e30, float("nan")  # ... and token 0's head 1 none at all
    merged = torch.empty(tokens, heads, kv_lora, dtype=dtype)
    merge_splits(part_o, part_lse, merged, pdl_launch(merged))
    want = absorb_out(merged, w_uv)
    got = absorb_out(LatentSplits(part_o, part_lse, dtype), w_uv)
    assert torch.equal(got, want) and not got.isnan().any() and torch.equal(got[0, 1], torch.zeros(V, dtype=dtype))
    with pytest.raises(ValueError, match="do not go together"):
        absorb_out(LatentSplits(part_o, part_lse, torch.float16), w_uv)
