"""A quantized DeepSeek-V3 checkpoint served with every quantized linear and every MoE layer on the GPU route
(the W4A16 / FP8 block kernels, the fused MoE; forced here and run under the Triton interpreter): prompt
logits and decode logits equal the same engine on the reference route (dequantize-then-matmul, the
expert loop). The checkpoints are written as tests/test_quantized_deepseek.py's and
tests/test_quantized_llama.py's: INT4 packed by compressed-tensors (DeepSeek: routed experts only),
FP8 block-wise everywhere."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():  # the engine runs these tiny models on the CPU, where only the interpreter runs kernels
    pytest.skip("CPU engines through the interpreter; on a GPU: tests/gpu/test_quant_kernels_gpu.py",
                allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit
pytest.importorskip("triton")
pytest.importorskip("compressed_tensors")

from deepseek_checkpoints import write_deepseek  # noqa: E402
from helpers import assert_rel, manual_greedy_logits, random_prompt  # noqa: E402
from quantized_deepseek_checkpoints import write_quantized_deepseek  # noqa: E402
from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.layers import moe, quantized_linear  # noqa: E402

PROMPT = random_prompt(90, 11, 512)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("kernel-route")
    write_deepseek(root / "src", seed=5, num_hidden_layers=3)  # layer 0 dense, 1 and 2 MoE
    for method in ("int4", "fp8"):
        write_quantized_deepseek(root / "src", root / method, root / f"{method}-twin", method)
    return root


def logits(folder) -> tuple[torch.Tensor, torch.Tensor]:
    with LLMEngine(EngineConfig(model=str(folder), page_size=8)) as eng:
        _, decode = manual_greedy_logits(eng, PROMPT, 3)
        return eng.prompt_logits(PROMPT), decode


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_the_kernel_route_equals_the_reference_route(folders, method, monkeypatch):
    from tandem.kernels import dequant_gemm, fused_moe

    reference = logits(folders / method)
    for module in (quantized_linear, moe):
        monkeypatch.setattr(module, "use_triton", lambda x: True)
    calls = {"linear": 0, "moe": 0, "moe slots": 0}

    def counted(fn, key):
        def call(*args, **kwargs):
            calls["moe slots" if key == "linear" and kwargs.get("ids") is not None else key] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(dequant_gemm, "_launch", counted(dequant_gemm._launch, "linear"))
    monkeypatch.setattr(fused_moe, "fused_moe", counted(fused_moe.fused_moe, "moe"))
    kernels = logits(folders / method)
    assert calls["moe"] > 0 and (calls["linear"] > 0) == (method != "int4"), calls  # Kimi-style INT4: experts only
    assert calls["moe slots"] > 0, calls  # a decode step's experts go slot by slot (tandem/kernels/moe_slots.py)
    assert_rel(kernels[0], reference[0], 1e-4, "prompt logits")
    assert_rel(kernels[1], reference[1], 1e-4, "decode logits")


def test_an_int4_llama_through_the_w4a16_kernel_equals_the_reference(tmp_path, monkeypatch):
    from quantized_checkpoints import write_quantized_llama
    from tandem.models.random_checkpoint import LlamaShape

    shape = LlamaShape(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                       num_kv_heads=2)
    write_quantized_llama(tmp_path / "int4", tmp_path / "twin", shape, "int4", seed=4)
    prompt = random_prompt(91, 9, 256)
    with LLMEngine(EngineConfig(model=str(tmp_path / "int4"))) as eng:
        reference = eng.prompt_logits(prompt)
    monkeypatch.setattr(quantized_linear, "use_triton", lambda x: True)
    with LLMEngine(EngineConfig(model=str(tmp_path / "int4"))) as eng:
        assert_rel(eng.prompt_logits(prompt), reference, 1e-4, "prompt logits")
