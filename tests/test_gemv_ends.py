"""The one-row quantized GEMV's fused ends (tandem/kernels/gemv_ends.py) on the CPU under the Triton interpreter:
paired (silu(gate) * up written by the gate/up launch), summed (the product added to the residual stream) and
prenormed (RMSNorm of such a stream applied by the projection that reads it).

References are independent of the kernels: weights packed and dequantized by ``compressed-tensors`` (INT4) or
quantized as the published FP8 block format says, the products in float64, rounded to the activation dtype and
then put through torch's own ops (``F.silu``, ``+``) or ``transformers``' ``LlamaRMSNorm``, each rounding to bf16
as a bf16 model does. (The interpreter's float-to-bf16 cast truncates where the GPU rounds, so the kernels' plain
stores are not compared bit for bit here: tests/gpu/test_quant_kernels_gpu.py does that on the GPU.) Then a
quantized Llama decodes with the ends on and off, in float32, against the reference route."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():
    pytest.skip("CPU kernels through the interpreter; on a GPU: tests/gpu/test_quant_kernels_gpu.py",
                allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit (imports below)
pytest.importorskip("triton")
pytest.importorskip("compressed_tensors")

from helpers import assert_rel, manual_greedy_logits, norm_rel_err, random_prompt  # noqa: E402
from quantized_checkpoints import fp8_block_quantize, write_quantized_llama  # noqa: E402
from test_quant_kernels import activations, int4_weight  # noqa: E402
from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.kernels import dequant_gemm  # noqa: E402
from tandem.kernels.dequant_gemm import ends_config, fused_linear  # noqa: E402
from tandem.kernels.dequant_tiles import FP8, INT4  # noqa: E402
from tandem.layers import fast_path, quantized_linear  # noqa: E402
from tandem.models.random_checkpoint import LlamaShape  # noqa: E402

GROUP = 32


def weight(fmt: int, n: int, k: int, seed: int):
    """(stored weight, scale, block, dequantized float) of a random [n, k] weight in ``fmt``."""
    if fmt == INT4:
        packed, scale, deq = int4_weight(n, k, GROUP, seed)
        return packed, scale, (1, GROUP), deq
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, scale_inv, deq = fp8_block_quantize(w, (16, 32))
    return q, scale_inv, (16, 32), deq


def products(x: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
    """x W^T in float64 on the unrounded dequantized weight (the GEMV multiplies it exactly), rounded to x's dtype."""
    return (x.double() @ deq.double().t()).to(x.dtype)


def assert_within_an_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: equal but for sums rounded the other way (the kernel sums in float32), one unit of the last place;
    float32: to float32 summation's error."""
    assert got.dtype == want.dtype and got.shape == want.shape and not got.isnan().any()
    if want.dtype == torch.float32:
        assert_rel(got, want, 1e-5, "float32")
        return
    ulp = torch.finfo(want.dtype).eps * want.float().abs() + torch.finfo(want.dtype).tiny
    assert ((got.float() - want.float()).abs() <= ulp).all(), (got - want).abs().max()


def rms_norm_reference(stream: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(stream.shape[-1], eps=eps).to(stream.dtype)
    norm.weight.data = g.clone()
    return norm(stream)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_paired_gemv_writes_silu_gate_times_up(dtype):
    inter, k = 48, 160  # three programs of 16 gate and 16 up rows (the interpreter's tile: 32 rows)
    w, scale, block, deq = weight(INT4, 2 * inter, k, seed=1)
    x = activations(1, k, dtype, seed=2)
    y = fused_linear(x, w, scale, INT4, block, pair_offset=inter)
    gate_up = products(x, deq)
    assert y.shape == (1, inter)
    assert_within_an_ulp(y, F.silu(gate_up[:, :inter]) * gate_up[:, inter:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", [INT4, FP8], ids=["int4", "fp8"])
def test_a_summed_gemv_adds_its_product_to_the_stream(fmt, dtype):
    n, k = 40, 160  # two programs, the second half empty
    w, scale, block, deq = weight(fmt, n, k, seed=3)
    x, residual = activations(1, k, dtype, seed=4), activations(1, n, dtype, seed=5)
    stream = fused_linear(x, w, scale, fmt, block, residual=residual)
    assert_within_an_ulp(stream, products(x, deq) + residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", [INT4, FP8], ids=["int4", "fp8"])
def test_a_prenormed_gemv_reads_the_norm_of_a_summed_stream(fmt, dtype):
    """o's summed launch, then the post-attention norm and gate/up (INT4: and its silu, paired) in one launch,
    against o, LlamaRMSNorm and the gate/up products apart. The fused route never rounds the normalised row to bf16,
    as LlamaRMSNorm does: bf16 results agree to that rounding."""
    hidden, k, inter, eps = 64, 96, 32, 1e-6
    w_o, s_o, block_o, deq_o = weight(fmt, hidden, k, seed=6)
    w_gu, s_gu, block_gu, deq_gu = weight(fmt, 2 * inter, hidden, seed=7)
    x, residual = activations(1, k, dtype, seed=8), activations(1, hidden, dtype, seed=9)
    g = (torch.rand(hidden, generator=torch.Generator().manual_seed(10)) + 0.5).to(dtype)
    stream = fused_linear(x, w_o, s_o, fmt, block_o, residual=residual)
    paired = inter if fmt == INT4 else 0
    act = fused_linear(stream, w_gu, s_gu, fmt, block_gu, pair_offset=paired, norm=(g, eps))
    gate_up = products(rms_norm_reference(stream, g, eps), deq_gu)
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:] if paired else gate_up
    if dtype == torch.float32:
        assert_rel(act, want, 1e-5, "float32")
    else:  # (the two routes' bf16 roundings, the interpreter's truncating stores among them)
        assert norm_rel_err(act, want) < 1e-2


def test_the_ends_apply_to_one_row_and_whole_pairs_only():
    assert ends_config(1, 96, 160, torch.bfloat16, INT4, GROUP) is not None
    assert ends_config(2, 96, 160, torch.bfloat16, INT4, GROUP) is None  # (a verify's rows: the plain kernels)
    assert ends_config(1, 2 * 40, 160, torch.bfloat16, INT4, GROUP, paired=True) is None  # 40 gate rows: not whole
    assert ends_config(1, 96, 160, torch.bfloat16, FP8, 32, paired=True) is None  # (FP8: summed and prenormed only)
    w, scale, block, _ = weight(INT4, 96, 160, seed=11)
    x = activations(1, 160, torch.bfloat16, seed=12)
    with pytest.raises(ValueError, match="twice pair_offset"):
        fused_linear(x, w, scale, INT4, block, pair_offset=40)
    with pytest.raises(ValueError, match="no bias"):
        fused_linear(x, w, scale, INT4, block, bias=torch.zeros(96, dtype=torch.bfloat16),
                     residual=activations(1, 96, torch.bfloat16, seed=13))
    assert fused_linear(activations(2, 160, torch.bfloat16, seed=14), w, scale, INT4, block, pair_offset=48) is None


@pytest.mark.parametrize("method,qkv_apart", [("int4", False), ("fp8", False), ("int4", True)],
                         ids=["int4", "fp8", "int4-qkv-apart"])
def test_a_quantized_llama_decodes_with_the_ends_as_without(method, qkv_apart, tmp_path, monkeypatch):
    """float32 (every rounding exact but the sums' order): each one-row decode step through the ends, the prompt
    through the plain kernels, against the reference route (dequantize, then matmul). ``qkv_apart``: qkv's tile
    takes no ends (a small N split in K, say), so the summed stream from down is normalised by the norm kernel."""
    shape = LlamaShape(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                       num_kv_heads=2, max_position_embeddings=128)
    write_quantized_llama(tmp_path / method, tmp_path / "twin", shape, method, seed=3, block=(16, 32))
    prompt = random_prompt(92, 7, 256)

    def decode():
        with LLMEngine(EngineConfig(model=str(tmp_path / method), page_size=4)) as eng:
            gen = torch.Generator().manual_seed(1)  # (a checkpoint's ones would hide a norm weight left out)
            for layer in eng.executor.runner.model.model.layers:
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    norm.weight.data = torch.rand(norm.weight.shape, generator=gen) + 0.5
            return manual_greedy_logits(eng, prompt, 4)

    reference_tokens, reference = decode()
    monkeypatch.setattr(quantized_linear, "use_triton", lambda x: True)
    ends = []
    original = dequant_gemm.fused_linear

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        if out is not None:
            ends.append("paired" if kwargs.get("pair_offset") else "summed" if kwargs.get("residual") is not None
                        else "prenormed")
        return out

    monkeypatch.setattr(dequant_gemm, "fused_linear", counted)
    qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * (shape.hidden_size // shape.num_heads)
    if qkv_apart:
        tile = dequant_gemm.ends_config
        monkeypatch.setattr(dequant_gemm, "ends_config",
                            lambda m, n, *a, **kw: None if n == qkv_rows else tile(m, n, *a, **kw))
    for on in (True, False):
        monkeypatch.setattr(fast_path, "FUSE_GEMV_ENDS", fast_path.GEMV_ENDS if on else frozenset())
        ends.clear()
        tokens, logits = decode()
        assert tokens == reference_tokens
        assert_rel(logits, reference, 1e-4, f"ends {'on' if on else 'off'}")
        steps, layers = 4, shape.num_layers
        # each step: every layer's o and down summed, gate/up paired (INT4; FP8: prenormed); qkv prenormed but in
        # layer 0
        paired = layers * steps if on and method == "int4" else 0
        prenormed = ((layers - 1) * steps if not qkv_apart else 0) + (layers * steps if method == "fp8" else 0)
        assert ends.count("summed") == (2 * layers * steps if on else 0), ends
        assert ends.count("paired") == paired and ends.count("prenormed") == (prenormed if on else 0), ends
