"""Split-K invariance on a real GPU, in bf16: a token's attention row computed by a decode step (q_len 1,
kv_len p + 1) equals, bit for bit, the same token's row in a verify step (a chain of W tokens, the token
at any row of it), for paged_attention and the MLA kernel, with 2 and 4 splits cut from the sequence's
split span (longer than, or shorter than, its length). What the controlled-acceptance benchmark needs
(bench/bench.py --sections spec_goal,deepseek at batch 8, where the graphs split the keys in 2): the verify
pass agreeing with target-only decoding. Unlike the CPU versions (tests/test_kernels.py,
tests/test_mla_kernel.py: the token leads its chain, as numpy's matmul rounds a row by its place in the
tile), the token sits anywhere in the chain here, so the two steps' tiles differ in height: this also
shows whether the GPU's dot rounds a row alike in both. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # before importing triton kernels: nothing here may run on the CPU
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from mla_cases import latent_case, latent_decode_and_verify_rows  # noqa: E402
from test_kernels import decode_and_verify_rows, one_sequence_pools  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.gpu
LENGTH = 4200
# Tokens around where kv_len-derived boundaries moved (multiples of splits x 64 keys), and others.
TOKENS = (100, 1020, 1022, 2045, 3071, 4100)


@pytest.mark.parametrize("span", [LENGTH + 300, 1500], ids=lambda s: f"span{s}")
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("width", [4, 8, 16])
def test_paged_attention_decode_and_verify_rows_are_the_same_bits(width, splits, span):
    """Llama-3-8B's attention shape (GQA 4, 8 kv heads, head_dim 128, pages of 16)."""
    q, k_pool, v_pool, table = one_sequence_pools(LENGTH + 16, 4, 8, 128, 16, torch.bfloat16, "cuda", seed=width)
    for p in TOKENS:
        for row in sorted({0, width // 2, width - 1}):
            decode, verify = decode_and_verify_rows(q, k_pool, v_pool, table, p, width, row, splits, span)
            assert torch.equal(decode, verify), (
                f"token {p}, row {row}: max diff {(decode.float() - verify.float()).abs().max().item()}")


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("heads,width", [(8, 4), (8, 8), (64, 4)])
def test_mla_decode_and_verify_rows_are_the_same_bits(heads, width, splits):
    """Kimi's latent (kv_lora 512, rope 64), 8 heads a rank at TP 8 and 64 at TP 1, pages of 64."""
    case = latent_case([(0, 3200, None)], heads, 512, 64, 64, dtype=torch.bfloat16, device="cuda", seed=heads + width)
    for p in (100, 1020, 2045, 3150):
        for span in (3500, 900):
            for row in sorted({0, width - 1}):
                decode, verify = latent_decode_and_verify_rows(case, 512, p, width, row, splits, span)
                assert torch.equal(decode, verify), (
                    f"token {p}, row {row}, span {span}: max diff {(decode.float() - verify.float()).abs().max().item()}")
