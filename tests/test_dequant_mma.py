"""The tensor-core W4A16 kernel for 1-16 rows (tandem/kernels/dequant_mma.py, ``DequantConfig(kernel="mma")``)
on the CPU under the Triton interpreter, against an independent reference: INT4 packed and dequantized by the
``compressed-tensors`` package itself, then ``x @ W.T`` in float64 on the unrounded dequantized weight (the
kernel multiplies the exact integers and applies the scale in float32).

The interpreter runs the kernel's pure-Triton unpack (inline PTX cannot run here), with the same tile
assembly (the nibble order), masks, split K and scales as the PTX branch; that branch is checked on a GPU
(tests/gpu/test_quant_kernels_gpu.py) and compiled for sm_90 by tests/test_kernels.py (compile_check).
Tiny shapes: N one and a quarter tiles (the last tile re-reads rows), K ending inside a step or a whole
number of steps (a split starting past K), 1, 3, 16 and 17 rows (two row blocks), bias, groups of 32 and 64.
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
from test_quant_kernels import DEVICE, TOL, activations, int4_weight, reference  # noqa: E402
from tandem.kernels import dequant_configs  # noqa: E402
from tandem.kernels.dequant_configs import DequantConfig  # noqa: E402
from tandem.kernels.dequant_gemm import fp8_block_linear, int4_linear  # noqa: E402
from tandem.kernels.dequant_tiles import FP8  # noqa: E402
from tandem.kernels.dequant_tiles import interpreting as dequant_tiles_interpreting  # noqa: E402

# (config, k): K = 2.5 steps (masked tail); K = 3 steps in 2 splits (the second split's last step lies past K:
# an unmasked re-read whose x is zero); K = 2.5 steps in 3 splits of one step
CASES = {"ragged-k": (DequantConfig(16, 64, 64, num_stages=1, kernel="mma"), 160),
         "even-k-split-2": (DequantConfig(8, 64, 64, num_stages=1, split_k=2, kernel="mma"), 192),
         "ragged-k-split-3": (DequantConfig(16, 64, 64, num_stages=1, split_k=3, kernel="mma"), 160)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 16, 17])
@pytest.mark.parametrize("case", list(CASES))
def test_int4_mma_matches_compressed_tensors(dtype, m, case):
    config, k = CASES[case]
    n, group = 80, 32
    packed, scale, deq = int4_weight(n, k, group, seed=m + k)
    x = activations(m, k, dtype, seed=300 + m)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(m)).to(DEVICE) if m != 16 else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    y = int4_linear(x, packed, scale, group, bias, config=config, out=out)
    assert y.dtype == dtype and not y.isnan().any()
    assert norm_rel_err(y, reference(x, deq, bias, exact=True)) < TOL[dtype]


def test_int4_mma_group_64_and_leading_dims():
    n, k, group = 72, 256, 64  # a step of 128 columns: two dots of one group each
    packed, scale, deq = int4_weight(n, k, group, seed=11)
    x = activations(3, k, torch.bfloat16, seed=12, lead=(2,))
    config = DequantConfig(8, 64, 128, num_stages=1, split_k=2, kernel="mma")
    y = int4_linear(x, packed, scale, group, config=config)
    assert y.shape == (2, 3, n)
    assert norm_rel_err(y, reference(x.reshape(6, k), deq, exact=True).reshape(2, 3, n)) < TOL[torch.bfloat16]


def test_int4_mma_max_rows_routes_the_default(monkeypatch):
    """INT4 with bf16/fp16 activations of more rows than the GEMV takes and up to INT4_MMA_MAX_ROWS goes to the mma
    kernel, below INT4_MMA_MAX_ELEMENTS weights; one row, float32 activations, more rows and the largest weights
    keep the other kernels."""
    assert dequant_configs.default_config(1, 4096, 7168).kernel == "gemv"
    assert dequant_configs.default_config(4, 4096, 7168).kernel == "gemv"
    assert dequant_configs.default_config(16, 4096, 7168).kernel == "mma"
    assert dequant_configs.default_config(8, 4096, 7168).block_m == 16
    assert dequant_configs.default_config(17, 4096, 7168).kernel == "dot"
    assert dequant_configs.default_config(16, 28672, 4096).kernel == "dot"  # 8B gate_up: the tiles
    assert dequant_configs.default_config(8, 4096, 7168, torch.float32).kernel != "mma"
    # where the caller gives the group size (groups of 32), bf16 at 4-8 rows and K a multiple of 128 take mma_sync on a
    # GPU; the interpreter never (Gluon does not run there)
    assert dequant_configs.default_config(4, 4096, 7168, group=32).kernel == "gemv"
    monkeypatch.setattr(dequant_configs, "interpreting", lambda: False)
    assert [dequant_configs.default_config(m, 4096, 7168, group=32).kernel for m in (3, 4, 8, 9)] == \
        ["gemv", "mma_sync", "mma_sync", "mma"]
    assert dequant_configs.default_config(8, 4096, 7100, group=32).kernel == "mma"  # K not a multiple of 128
    assert dequant_configs.default_config(8, 4096, 7168, torch.float16, group=32).kernel == "mma"
    assert dequant_configs.default_config(8, 4096, 7168, group=128).kernel == "mma"
    assert dequant_configs.default_config(8, 4096, 7168, fmt=FP8, group=32).kernel != "mma_sync"
    monkeypatch.setattr(dequant_configs, "gluon_available", lambda: False)  # a Triton without Gluon (before 3.5)
    assert dequant_configs.default_config(8, 4096, 7168, group=32).kernel == "mma"
    monkeypatch.setattr(dequant_configs, "interpreting", dequant_tiles_interpreting)
    monkeypatch.setattr(dequant_configs, "INT4_MMA_MAX_ROWS", 4)
    assert dequant_configs.default_config(8, 4096, 7168).kernel == "dot"
    monkeypatch.setattr(dequant_configs, "GEMV_MAX_ROWS", 1)
    assert dequant_configs.default_config(2, 4096, 7168).kernel == "mma"
    n, k, group = 40, 96, 32
    packed, scale, deq = int4_weight(n, k, group, seed=3)
    x = activations(2, k, torch.bfloat16, seed=4)
    assert norm_rel_err(int4_linear(x, packed, scale, group), reference(x, deq, exact=True)) < TOL[torch.bfloat16]


def test_what_the_mma_kernel_refuses():
    n, k = 16, 64
    packed, scale, _ = int4_weight(n, k, 32, seed=1)
    config = DequantConfig(16, 64, 64, num_stages=1, kernel="mma")
    with pytest.raises(ValueError, match="mma"):
        int4_linear(activations(1, k, torch.float32, seed=2), packed, scale, 32, config=config)
    q, scale_inv, _ = (t.to(DEVICE) for t in fp8_block_quantize(torch.randn(n, k) * 0.05, (16, 32)))
    with pytest.raises(ValueError, match="mma"):
        fp8_block_linear(activations(1, k, torch.bfloat16, seed=2), q, scale_inv, (16, 32), config=config)
    with pytest.raises(ValueError, match="block_m"):
        DequantConfig(4, 64, 64, kernel="mma")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs it: tests/gpu/test_quant_kernels_gpu.py")
def test_mma_sync_kernel_is_refused_in_words_where_it_cannot_run():
    """The register-fed mma.sync kernel (tandem/kernels/dequant_mma_sync.py) is Gluon, which the interpreter does not
    run: asked for on the CPU it says so in a ValueError, as it does for a tile or format it does not take (checked
    first). Its arithmetic is checked on a GPU and its compilation for sm_90 by tests/test_kernels.py."""
    w, s, _ = int4_weight(64, 256, 32, seed=1)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Gluon kernels do not run under the Triton interpreter"):
        int4_linear(x, w, s, 32, config=DequantConfig(8, 64, 128, 4, 1, kernel="mma_sync"))
    with pytest.raises(ValueError, match="64 or 128 rows of W"):
        int4_linear(x, w, s, 32, config=DequantConfig(8, 96, 128, 4, 1, kernel="mma_sync"))
    with pytest.raises(ValueError, match="'mma_sync' block_m 8"):
        DequantConfig(16, 64, 128, 4, 1, kernel="mma_sync")
