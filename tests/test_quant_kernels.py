"""The W4A16 and FP8 block-wise (W8A16) linear kernels (tandem/kernels/dequant_gemm.py) on the CPU under the
Triton interpreter, against the dequantize-then-matmul reference: INT4 packed and dequantized by the
``compressed-tensors`` package itself, FP8 block-wise quantized as the published format says
(tests/quantized_checkpoints.py), never tandem's own unpacking.

Tiny shapes with ragged edges (N not a multiple of the tile, K ending inside a tile and a block), 1-4
rows (decode / verify GEMV tiles) and a few dozen rows (GEMM tiles), tiles that expand whole groups and
tiles that gather scales per element, float32 and bf16 activations. Outputs are poisoned with NaN first.
GPU versions at serving shapes: tests/gpu/test_quant_kernels_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit (import below)
pytest.importorskip("triton")
pytest.importorskip("compressed_tensors")

from quantized_checkpoints import fp8_block_quantize, int4_compress  # noqa: E402
from helpers import norm_rel_err  # noqa: E402
from tandem.kernels.dequant_configs import DequantConfig  # noqa: E402
from tandem.kernels.dequant_gemm import fp8_block_linear, int4_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
SMALL = DequantConfig(16, 16, 64, num_warps=4, num_stages=2)  # several N tiles and K steps on tiny shapes
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}



def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              exact: bool = False) -> torch.Tensor:
    """x times the dequantized weight rounded to x's dtype (what the tensor-core kernel multiplies; ``exact``:
    unrounded, what the gemv kernel multiplies), in float64."""
    y = x.double() @ (w if exact else w.to(x.dtype)).double().t()
    return y + bias.double() if bias is not None else y


def int4_weight(n: int, k: int, group: int, seed: int):
    """(packed, scale, dequantized) of a random bf16 [n, k] weight, all by compressed-tensors (its scales in bf16,
    as it stores a bf16 model's)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    packed, deq = int4_compress(w.bfloat16(), group)
    assert packed["weight_scale"].dtype == torch.bfloat16
    return packed["weight_packed"].to(DEVICE), packed["weight_scale"].to(DEVICE), deq.to(DEVICE)


def activations(m: int, k: int, dtype: torch.dtype, seed: int, lead: tuple[int, ...] = ()) -> torch.Tensor:
    return torch.randn(*lead, m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 4, 37])
@pytest.mark.parametrize("config", [SMALL, DequantConfig(16, 32, 16, 4, 2), DequantConfig(16, 16, 32, 4, 2, split_k=3),
                                    DequantConfig(1, 8, 64, 4, 2, kernel="rows"), None],
                         ids=["whole-groups", "gathered-scales", "split-k", "rows", "default"])
def test_int4_linear_matches_compressed_tensors_dequantization(dtype, m, config):
    check_int4_linear(dtype, m, config)


def check_int4_linear(dtype: torch.dtype, m: int, config: DequantConfig | None, exact: bool = False):
    """``m`` rows times a 40 x 160 weight (group 32; K = 2.5 tiles of 64, N = 2.5 tiles of 16) against
    ``reference(..., exact)``, the output poisoned with NaN first."""
    n, k, group = 40, 160, 32
    packed, scale, deq = int4_weight(n, k, group, seed=m)
    x = activations(m, k, dtype, seed=100 + m)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    y = int4_linear(x, packed, scale, group, config=config, out=out)
    assert y.dtype == dtype and not y.isnan().any()
    assert norm_rel_err(y, reference(x, deq, exact=exact)) < TOL[dtype]


@pytest.mark.parametrize("config", [SMALL, DequantConfig(16, 16, 64, 4, 2, split_k=2),
                                    DequantConfig(1, 8, 64, 4, 2, kernel="rows"), None],
                         ids=["whole-groups", "split-k", "rows", "default"])
def test_int4_kernels_give_the_same_output_for_scales_held_in_any_float_dtype(config):
    """The scales are held as the checkpoint stores them (bf16 here) and widened as read: the same values held in
    float32 or fp16 (exact copies) give bit-identical outputs."""
    n, k, group = 40, 160, 32
    packed, scale, _ = int4_weight(n, k, group, seed=9)
    x = activations(4, k, torch.bfloat16, seed=10)
    held = int4_linear(x, packed, scale, group, config=config)
    for dtype in (torch.float32, torch.float16):
        assert torch.equal(scale.to(dtype).to(scale.dtype), scale)  # an exact copy of the values
        assert torch.equal(int4_linear(x, packed, scale.to(dtype), group, config=config), held), dtype


def test_int4_linear_bias_leading_dims_and_group_64():
    n, k, group = 24, 192, 64
    packed, scale, deq = int4_weight(n, k, group, seed=5)
    x = activations(3, k, torch.float32, seed=6, lead=(2,))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    for config in (SMALL, DequantConfig(16, 16, 64, 4, 2, split_k=2), DequantConfig(1, 8, 64, 4, 2, kernel="rows")):
        y = int4_linear(x, packed, scale, group, bias, config=config)
        assert y.shape == (2, 3, n)
        assert norm_rel_err(y, reference(x, deq, bias)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 33])
@pytest.mark.parametrize("block,config", [((32, 64), SMALL), ((32, 64), DequantConfig(16, 32, 128, 4, 2)),
                                          ((32, 48), DequantConfig(16, 32, 32, 4, 2)),
                                          ((32, 64), DequantConfig(16, 16, 64, 4, 2, split_k=3)),
                                          ((32, 64), DequantConfig(1, 4, 128, 4, 2, split_k=2, kernel="rows"))],
                         ids=["one-block-per-step", "two-blocks-per-step", "gathered-scales", "split-k", "rows-split-k"])
def test_fp8_block_linear_matches_the_published_dequantization(dtype, m, block, config):
    n, k = 72, 224  # edge blocks on both dims: 72 = 2 x 32 + 8, 224 = 3 x 64 + 32 = 4 x 48 + 32
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(m)) * 0.05
    q, scale_inv, deq = (t.to(DEVICE) for t in fp8_block_quantize(w, block))
    x = activations(m, k, dtype, seed=200 + m)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    y = fp8_block_linear(x, q, scale_inv, block, config=config, out=out)
    assert not y.isnan().any()
    assert norm_rel_err(y, reference(x, deq)) < TOL[dtype]


def test_kernels_refuse_mismatched_layouts():
    packed, scale, _ = int4_weight(16, 64, 32, seed=1)
    with pytest.raises(ValueError, match="scale"):
        int4_linear(activations(1, 64, torch.float32, 2), packed, scale[:, :1], 32)
    q, scale_inv, _ = fp8_block_quantize(torch.randn(16, 64), (16, 32))
    with pytest.raises(ValueError, match="expected"):
        fp8_block_linear(activations(1, 64, torch.float32, 2), q.to(DEVICE), scale_inv[:, :1].to(DEVICE), (16, 32))


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_quantized_layers_dispatch_to_the_kernels(method, monkeypatch):
    """A quantized MergedColumnParallelLinear computes the same through the kernel (the GPU route, forced
    here on the CPU) as through its float reference (the CPU route, called directly)."""
    from tandem.layers import quantized_linear
    from tandem.layers.linear import MergedColumnParallelLinear
    from tandem.configs.quantization import Fp8Block, Int4Group, QuantConfig

    scheme = Int4Group(32) if method == "int4" else Fp8Block((32, 32))
    quant = QuantConfig("compressed-tensors" if method == "int4" else "fp8", scheme)
    fmt = quantized_linear.linear_format(quant, "mlp.", ("gate_proj", "up_proj"))
    with torch.device(DEVICE):
        layer = MergedColumnParallelLinear(64, [32, 32], quant=fmt)
    for part in range(2):
        w = torch.randn(32, 64, generator=torch.Generator().manual_seed(part)) * 0.05
        if method == "int4":
            packed, _ = int4_compress(w.bfloat16(), 32)
            layer.load_weight("weight_packed", packed["weight_packed"], part)
            layer.load_weight("weight_scale", packed["weight_scale"], part)
        else:
            q, scale_inv, _ = fp8_block_quantize(w, (32, 32))
            layer.load_weight("weight", q, part)
            layer.load_weight("weight_scale_inv", scale_inv, part)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    ref = quantized_linear.QuantFormat.apply(fmt, layer, x, None)  # the dequantize-then-matmul route
    monkeypatch.setattr(quantized_linear, "use_triton", lambda t: True)
    assert norm_rel_err(layer(x), ref) < 1e-5


def test_a_config_names_a_kernel_its_rows_fit():
    with pytest.raises(ValueError, match="block_m"):
        DequantConfig(16, 8, 64, kernel="rows")
    with pytest.raises(ValueError, match="block_m"):
        DequantConfig(1, 8, 64)


def test_default_tiles_split_k_only_where_n_leaves_too_few_programs():
    from tandem.kernels.dequant_configs import default_config

    assert default_config(4, 512, 7168, gemv_max_rows=0).split_k > 1  # a TP 8 shared expert's gate/up, 4 rows
    assert default_config(1, 28672, 4096, gemv_max_rows=0).split_k == 1 and default_config(64, 512, 7168).split_k == 1


def test_one_row_over_a_long_k_takes_the_cuda_core_kernel():
    """Without the GEMV kernel (tests/test_dequant_gemv.py), where the H200 measured it faster (K 7168 and
    14336, one row); the tensor-core tiles elsewhere."""
    from tandem.kernels.dequant_configs import default_config

    def kernel(m, n, k):
        return default_config(m, n, k, gemv_max_rows=0).kernel

    assert kernel(1, 512, 7168) == "rows" and kernel(1, 4096, 14336) == "rows"
    assert kernel(1, 28672, 4096) == "dot" and kernel(4, 4096, 14336) == "dot"


def test_the_tile_configs_above_cover_each_way_of_loading_scales():
    from tandem.kernels.dequant_tiles import FP8, INT4, whole_groups

    assert whole_groups(INT4, 32, 64) and not whole_groups(INT4, 32, 16)  # whole-groups / gathered-scales
    assert whole_groups(FP8, 64, 64) and whole_groups(FP8, 64, 128) and not whole_groups(FP8, 48, 32)
