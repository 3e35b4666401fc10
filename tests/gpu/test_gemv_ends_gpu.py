"""The one-row quantized GEMV's fused ends (tandem/kernels/gemv_ends.py) on a real GPU at the Llama-3.1-8B shape,
bf16, INT4 and FP8 block weights: each end against the route it replaces — the plain GEMV, then the activation or
norm kernel — bit for bit where the roundings are the same ops (paired, summed), and as close to the route in
float32 as that route in bf16 where the prenormed end leaves out the normalised row's rounding; then a layer's chain of them captured in a CUDA graph and
replayed with new inputs. (The CPU tests compare with independent float64 references: tests/test_gemv_ends.py.)"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # before importing triton kernels: nothing here may run on the CPU
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from helpers import capture_graph, norm_rel_err  # noqa: E402
from test_quant_kernels_gpu import BLOCK, GROUP, random_int4  # noqa: E402

from tandem.kernels.activation import silu_and_mul  # noqa: E402
from tandem.kernels.dequant_gemm import fp8_block_linear, fused_linear, int4_linear  # noqa: E402
from tandem.kernels.dequant_tiles import FP8, INT4  # noqa: E402
from tandem.kernels.norm import rms_norm  # noqa: E402

pytestmark = pytest.mark.gpu
HIDDEN, INTER, EPS = 4096, 14336, 1e-5


def weight(fmt: int, n: int, k: int, seed: int):
    """(stored weight, scale, block) in ``fmt``; plain(x) the unfused product."""
    if fmt == INT4:
        packed, scale = random_int4(n, k, seed)
        return packed, scale, (1, GROUP), lambda x: int4_linear(x, packed, scale, GROUP)
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, generator=g, device="cuda") * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(-(-n // BLOCK[0]), -(-k // BLOCK[1]), generator=g, device="cuda") * 1e-3
    return w, scale_inv, BLOCK, lambda x: fp8_block_linear(x, w, scale_inv, BLOCK)


def row(k: int, seed: int) -> torch.Tensor:
    return torch.randn(1, k, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda").bfloat16()


def test_paired_gate_up_equals_the_gemv_then_the_activation_kernel():
    w, scale, block, plain = weight(INT4, 2 * INTER, HIDDEN, seed=1)
    x = row(HIDDEN, 2)
    act = fused_linear(x, w, scale, INT4, block, pair_offset=INTER)
    assert torch.equal(act, silu_and_mul(plain(x)))


@pytest.mark.parametrize("fmt", [INT4, FP8], ids=["int4", "fp8"])
@pytest.mark.parametrize("k", [HIDDEN, INTER], ids=["o", "down"])
def test_summed_o_and_down_equal_the_gemv_then_the_norms_add(fmt, k):
    w, scale, block, plain = weight(fmt, HIDDEN, k, seed=k)
    x, residual = row(k, 3), row(HIDDEN, 4)
    stream = fused_linear(x, w, scale, fmt, block, residual=residual)
    _, want = rms_norm(plain(x), torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16), EPS, residual=residual)
    assert torch.equal(stream, want)


@pytest.mark.parametrize("fmt", [INT4, FP8], ids=["int4", "fp8"])
def test_a_layers_chain_of_ends_equals_the_plain_route_and_replays_in_a_graph(fmt):
    """o summed, gate/up prenormed (and paired: INT4), down summed, the next layer's qkv prenormed: against the
    GEMVs with the norm and activation kernels between them; then captured once and replayed on new inputs."""
    w_o, s_o, b_o, o = weight(fmt, HIDDEN, HIDDEN, seed=5)
    w_gu, s_gu, b_gu, gate_up = weight(fmt, 2 * INTER, HIDDEN, seed=6)
    w_d, s_d, b_d, down = weight(fmt, HIDDEN, INTER, seed=7)
    w_q, s_q, b_q, qkv = weight(fmt, 6144, HIDDEN, seed=8)
    g1, g2 = (torch.rand(2, HIDDEN, device="cuda") + 0.5).bfloat16()
    x, residual = row(HIDDEN, 9), row(HIDDEN, 10)

    def fused():
        stream = fused_linear(x, w_o, s_o, fmt, b_o, residual=residual)
        act = fused_linear(stream, w_gu, s_gu, fmt, b_gu, pair_offset=INTER if fmt == INT4 else 0, norm=(g1, EPS))
        if fmt == FP8:
            act = silu_and_mul(act)
        stream2 = fused_linear(act, w_d, s_d, fmt, b_d, residual=stream)
        return fused_linear(stream2, w_q, s_q, fmt, b_q, norm=(g2, EPS))

    def plain(dtype=torch.bfloat16):
        normed, stream = rms_norm(o(x.to(dtype)), g1.to(dtype), EPS, residual=residual.to(dtype))
        normed2, _ = rms_norm(down(silu_and_mul(gate_up(normed))), g2.to(dtype), EPS, residual=stream)
        return qkv(normed2)

    # Both bf16 routes against the same route in float32: the fused one rounds differently (never the normalised
    # rows), not worse
    reference = plain(torch.float32)
    got, want = fused(), plain()
    assert norm_rel_err(got, reference) < 1.25 * norm_rel_err(want, reference) + 1e-4
    graph, out = capture_graph(fused)
    for seed in (11, 12):
        x.copy_(row(HIDDEN, seed))
        residual.copy_(row(HIDDEN, seed + 10))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused())


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_a_quantized_llama_with_the_ends_on_equals_its_float32_twin(method, tmp_path, monkeypatch):
    """The engine on the GPU in float32 with the ends on (CUDA graphs: the decode steps replay them) against a CPU
    engine on the dequantized float32 twin: prompt logits and greedy output, each end counted at the capture."""
    from helpers import random_prompt
    from quantized_checkpoints import write_quantized_llama
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.kernels import dequant_gemm
    from tandem.layers import fast_path
    from tandem.models.random_checkpoint import LlamaShape
    from tandem.sampling import SamplingParams

    shape = LlamaShape(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                       num_kv_heads=2)
    write_quantized_llama(tmp_path / "q", tmp_path / "twin", shape, method, seed=4)
    prompt, params = random_prompt(93, 13, 256), SamplingParams(max_new_tokens=12, ignore_eos=True)
    used = []
    original = dequant_gemm.fused_linear

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        used.append(out is not None)
        return out

    monkeypatch.setattr(dequant_gemm, "fused_linear", counted)
    results = []
    for folder, kw in ((tmp_path / "q", {"device": "cuda", "dtype": "float32"}), (tmp_path / "twin", {})):
        monkeypatch.setattr(fast_path, "FUSE_GEMV_ENDS", fast_path.GEMV_ENDS if "device" in kw else frozenset())
        with LLMEngine(EngineConfig(model=str(folder), page_size=8, **kw)) as eng:
            greedy = eng.generate([prompt], params)[0].output_token_ids
            results.append((eng.prompt_logits(prompt).float().cpu(), greedy))
    (gpu_logits, gpu_greedy), (cpu_logits, cpu_greedy) = results
    assert any(used), "no fused end was taken"
    assert norm_rel_err(gpu_logits, cpu_logits) < 1e-4
    assert gpu_greedy == cpu_greedy
