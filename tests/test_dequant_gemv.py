"""The GEMV kernel for 1-4 rows of quantized linear layers (tandem/kernels/dequant_gemv.py) on the CPU under
the Triton interpreter, against an independent reference: INT4 packed and dequantized by the
``compressed-tensors`` package itself, FP8 block-wise quantized as the published format says
(tests/quantized_checkpoints.py), then ``x @ W.T`` in float64 on the unrounded dequantized weight (the
kernel multiplies it exactly in float32).

Tiny shapes: N a multiple of the tile and not (the last tile re-reads rows), K ending inside a step,
1-4 rows (and 3 rows in programs of 2: a masked row), K split or not, with and without bias, float32 and bf16
activations; FP8 blocks whose rows hold the whole tile or not, and whose columns a step holds or lies
inside. Outputs are poisoned with NaN first. The helpers are tests/test_quant_kernels.py's (the other
kernels' tests). Compiled for sm_90: tests/test_kernels.py (compile_check).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit (import below)
pytest.importorskip("triton")
pytest.importorskip("compressed_tensors")

from helpers import norm_rel_err  # noqa: E402
from quantized_checkpoints import fp8_block_quantize  # noqa: E402
from test_quant_kernels import DEVICE, TOL, activations, check_int4_linear, int4_weight, reference  # noqa: E402
from tandem.kernels.dequant_configs import DequantConfig, default_config  # noqa: E402
from tandem.kernels.dequant_gemm import fp8_block_linear, int4_linear  # noqa: E402
from tandem.kernels.dequant_tiles import FP8, INT4  # noqa: E402

EVEN_N = DequantConfig(4, 8, 64, num_stages=1, kernel="gemv")  # N = 5 tiles, K = 2.5 steps
RAGGED_N_SPLIT = DequantConfig(4, 16, 64, num_stages=1, split_k=2, kernel="gemv")  # N = 2.5 tiles, K in 2 splits
# three and four steps in flight: more than the 2.5 steps of K, and more than a split's steps
THREE_AHEAD = DequantConfig(4, 8, 32, num_stages=3, kernel="gemv")
FOUR_AHEAD_SPLIT = DequantConfig(4, 16, 32, num_stages=4, split_k=2, kernel="gemv")
# K in whole steps, not split (as THREE_AHEAD): the read-ahead past the last step re-reads it, unmasked
THREE_AHEAD_CLAMPED = DequantConfig(4, 8, 32, num_stages=3, kernel="gemv", clamped_read_ahead=True)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("config", [EVEN_N, RAGGED_N_SPLIT, THREE_AHEAD, THREE_AHEAD_CLAMPED, FOUR_AHEAD_SPLIT],
                         ids=["even-n", "ragged-n-split-k", "three-steps-in-flight", "three-in-flight-clamped",
                              "four-in-flight-split-k"])
def test_int4_gemv_matches_compressed_tensors(dtype, m, config):
    check_int4_linear(dtype, m, config, exact=True)


@pytest.mark.parametrize("config", [EVEN_N, FOUR_AHEAD_SPLIT], ids=["even-n", "four-in-flight-split-k"])
def test_int4_gemv_keeps_tiny_and_large_activations(config):
    """The kernel reads nibbles as subnormal floats and carries their place in the activation (dequant_gemv's
    _nibble): activations from 2^-40 to 2^40 in one row, float32, still give the float64 product to 1e-5 of
    each column's share (a flushed subnormal or an overflowed activation would zero or poison whole columns)."""
    n, k, group = 40, 160, 32
    packed, scale, deq = int4_weight(n, k, group, seed=21)
    magnitude = 2.0 ** torch.linspace(-40, 40, k).round()
    x = (activations(1, k, torch.float32, seed=22) * magnitude.to(DEVICE)).float()
    y = int4_linear(x, packed, scale, group, config=config)
    want = reference(x, deq, exact=True)
    # per column of x: the error is judged against the largest term, or the tiny columns would drown in the big
    for cols in (slice(0, 32), slice(64, 96), slice(128, 160)):
        part = int4_linear(x[:, cols].contiguous(), packed[:, cols.start // 8:cols.stop // 8].contiguous(),
                           scale[:, cols.start // group:cols.stop // group].contiguous(), group, config=config)
        assert norm_rel_err(part, reference(x[:, cols], deq[:, cols], exact=True)) < 1e-5
    assert norm_rel_err(y, want) < 1e-5


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("split", [1, 3])
def test_int4_gemv_bias_and_group_64(m, split):
    n, k, group = 24, 192, 64  # a step of 64 columns is one group
    packed, scale, deq = int4_weight(n, k, group, seed=5)
    x = activations(m, k, torch.float32, seed=6)
    bias = torch.randn(n, generator=gen(7)).to(DEVICE)
    config = DequantConfig(4, 8, 64, num_stages=1, split_k=split, kernel="gemv")
    y = int4_linear(x, packed, scale, group, bias, config=config)
    assert norm_rel_err(y, reference(x, deq, bias, exact=True)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("block,config", [((32, 64), EVEN_N), ((32, 64), RAGGED_N_SPLIT),
                                          ((32, 64), DequantConfig(2, 64, 64, num_stages=1, kernel="gemv")),
                                          ((32, 48), DequantConfig(4, 8, 64, num_stages=1, split_k=3, kernel="gemv")),
                                          ((32, 64), FOUR_AHEAD_SPLIT)],
                         ids=["one-block-row", "ragged-n-split-k", "tile-spans-block-rows", "step-inside-a-block",
                              "four-in-flight-split-k"])
def test_fp8_gemv_matches_the_published_dequantization(dtype, m, block, config):
    n, k = 72, 224  # edge blocks on both dims: 72 = 2 x 32 + 8, 224 = 3 x 64 + 32 = 4 x 48 + 32
    q, scale_inv, deq = (t.to(DEVICE) for t in fp8_block_quantize(torch.randn(n, k, generator=gen(m)) * 0.05, block))
    x = activations(m, k, dtype, seed=200 + m)
    bias = torch.randn(n, generator=gen(8)).to(DEVICE) if m == 3 else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    y = fp8_block_linear(x, q, scale_inv, block, bias, config=config, out=out)
    assert not y.isnan().any()
    assert norm_rel_err(y, reference(x, deq, bias, exact=True)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt,config", [("int4", EVEN_N), ("int4", RAGGED_N_SPLIT), ("fp8", EVEN_N),
                                        ("int4", DequantConfig(16, 16, 32, 4, 2))],
                         ids=["int4-gemv", "int4-gemv-split-k", "fp8-gemv", "int4-tiles"])
@pytest.mark.parametrize("folded", [True, False], ids=["read-by-the-gemv", "computed-first"])
def test_swiglu_rows_multiply_silu_of_gate_times_up(dtype, fmt, config, folded, monkeypatch):
    """``swiglu``: the input is [gate | up] and the product is with silu(gate) * up (rounded to x's dtype as torch's
    two ops round it) — read so by the GEMV kernel (unless activation.SWIGLU_FOLD_MAX says to compute it first),
    computed apart before the tile kernels."""
    from tandem.kernels import activation

    if not folded:
        monkeypatch.setattr(activation, "SWIGLU_FOLD_MAX", 0)
    n, k, m = 40, 160, (1 if config.kernel == "gemv" else 5)
    if fmt == "int4":
        packed, scale, deq = int4_weight(n, k, 32, seed=11)
        run = lambda x, **kw: int4_linear(x, packed, scale, 32, config=config, **kw)  # noqa: E731
    else:
        q, scale_inv, deq = (t.to(DEVICE) for t in fp8_block_quantize(torch.randn(n, k, generator=gen(12)) * 0.05,
                                                                      (32, 64)))
        run = lambda x, **kw: fp8_block_linear(x, q, scale_inv, (32, 64), config=config, **kw)  # noqa: E731
    gate_up = activations(m, 2 * k, dtype, seed=13)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype)  # torch's roundings, to nearest
    y = run(gate_up, swiglu=True)
    assert y.shape == (m, n)
    assert norm_rel_err(y, reference(act, deq, exact=config.kernel == "gemv")) < TOL[dtype]


def test_up_to_four_rows_take_the_gemv_kernel_by_default(monkeypatch):
    """GEMV_MAX_ROWS (the bench's ``old default`` passes 0); K split only where N leaves too few programs;
    the step holds 1024 columns (FP8 at 2-4 rows: 512). (The GPU's tiles: the interpreter takes wider ones.)"""
    from tandem.kernels import dequant_configs

    monkeypatch.setattr(dequant_configs, "interpreting", lambda: False)
    assert default_config(1, 4096, 7168).kernel == "gemv" and default_config(4, 4096, 7168).kernel == "gemv"
    assert default_config(5, 4096, 7168).kernel == "mma" and default_config(5, 4096, 7168, fmt=FP8).kernel == "dot"
    assert default_config(1, 4096, 7168, gemv_max_rows=0).kernel == "rows"
    assert default_config(1, 28672, 4096).split_k == 1 and default_config(1, 4096, 14336).split_k == 1
    assert default_config(1, 512, 7168).split_k == 7  # a TP 8 shared expert: 64 programs, 7 steps of 1024
    assert default_config(1, 4096, 7168, fmt=INT4).block_k == 1024
    assert default_config(1, 4096, 7168, fmt=FP8).block_k == 1024 and default_config(2, 4096, 7168, fmt=FP8).block_k == 512
    # FP8 at 2-4 rows of the largest weights: the tensor-core tile (measured faster on the H200 there)
    assert default_config(4, 28672, 4096, fmt=FP8).kernel == "dot" and default_config(1, 28672, 4096, fmt=FP8).kernel == "gemv"
    assert default_config(4, 4096, 7168, fmt=FP8).kernel == "gemv" and default_config(4, 28672, 4096, fmt=INT4).kernel == "gemv"
    # one INT4 row of a dense linear keeps more K steps in flight; expert slots, FP8 and more rows keep one
    tile = lambda cfg: (cfg.block_n, cfg.num_stages)  # noqa: E731
    assert tile(default_config(1, 28672, 4096)) == (8, 3) and tile(default_config(1, 4096, 14336)) == (4, 4)
    assert tile(default_config(1, 28672, 4096, slots=True)) == (8, 1) and tile(default_config(2, 28672, 4096)) == (8, 1)
    assert tile(default_config(1, 28672, 4096, fmt=FP8)) == (8, 1)


def test_groups_the_gemv_kernel_cannot_take():
    """FP8 blocks of 6 columns (a 4-byte word would straddle two scales): an explicit gemv config is
    refused, the default falls back to the tensor-core kernel."""
    n, k, block = 16, 48, (8, 6)
    q, scale_inv, deq = (t.to(DEVICE) for t in fp8_block_quantize(torch.randn(n, k, generator=gen(3)) * 0.05, block))
    x = activations(1, k, torch.float32, seed=4)
    with pytest.raises(ValueError, match="GEMV"):
        fp8_block_linear(x, q, scale_inv, block, config=EVEN_N)
    assert norm_rel_err(fp8_block_linear(x, q, scale_inv, block), reference(x, deq, exact=True)) < 1e-5
