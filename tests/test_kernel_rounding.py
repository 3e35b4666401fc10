"""tandem/kernels/rounding.round_to against torch's own cast to bf16 (round to nearest, ties to even): random
floats over many binades, exact ties (both parities), values that carry into the exponent, zeros and
infinities. Under the Triton interpreter on the CPU; on a GPU the same kernel compiles."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit (import below)
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tandem.kernels.rounding import round_to  # noqa: E402


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    tl.store(out_ptr + i, round_to(tl.load(x_ptr + i, mask=ok, other=0.0), tl.bfloat16), mask=ok)


def test_round_to_bf16_equals_torchs_cast():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    random = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-40, 40, (4096,), generator=g).float())
    upper = torch.randint(0, 0x7F80, (512,), generator=g, dtype=torch.int32) << 16  # finite upper halves
    ties = (upper | 0x8000).view(torch.float32)  # exactly half way: even and odd upper halves both occur
    carries = torch.tensor([0x3F7FFFFF, 0x3FFFFFFF, 0x7F7F8000, 0x3F808000, 0x3F818000], dtype=torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1.0, -1.5])
    x = torch.cat([random, ties, -ties, carries, special]).to(device)
    out = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    want = x.bfloat16().float()
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
