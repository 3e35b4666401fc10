"""The layers' input RMSNorm applied inside their first projection's one-row GEMV (tandem/layers/linear.py's
``forward_normed``, tandem/kernels/gemv.py's InputNorm) — a batch-1 decode path of the GPU — run on the CPU under
the Triton interpreter by letting the linear layers take the Triton route for CPU tensors: a bf16 Llama and a bf16
DeepSeek-V3 (fused q/kv_a; the MoE layer's post-attention norm inside its router's GEMV) decode, teacher-forced,
against the same engines with the norm run first (``FUSE_INPUT_NORMS`` off). Norm weights are randomised (a
checkpoint's ones would hide a missing multiply)."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CPU engines through the interpreter; the GPU runs these kernels in its own tests",
                allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit
pytest.importorskip("triton")

from deepseek_checkpoints import write_deepseek  # noqa: E402
from helpers import norm_rel_err, random_prompt  # noqa: E402
from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.forward_batch import ForwardBatch, SequenceChunk  # noqa: E402
from tandem.kv_cache import SequenceKV  # noqa: E402
from tandem.layers import fast_path, linear  # noqa: E402
from tandem.layers.moe import MoE  # noqa: E402
from tandem.layers.moe_router import NoAuxRouter  # noqa: E402
from tandem.models.random_checkpoint import LlamaShape, write_random_llama  # noqa: E402


def _teacher_forced(engine, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """The prompt's prefill, then one forward a token of the rest: each decode step's logits [n, V]."""
    kv = SequenceKV(engine.allocator)
    rows = []
    try:
        kv.reserve(prompt_len)
        engine.executor.forward(ForwardBatch([SequenceChunk(tokens[:prompt_len], 0, list(kv.pages))]))
        for pos in range(prompt_len, len(tokens)):
            kv.reserve(pos + 1)
            logits, _ = engine.executor.forward(ForwardBatch([SequenceChunk([tokens[pos]], pos, list(kv.pages))]))
            rows.append(logits[0].float())
    finally:
        kv.release()
    return torch.stack(rows)


@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_the_input_norm_inside_the_first_projection_decodes_as_the_norm_run_first(model, tmp_path, monkeypatch):
    if model == "llama":
        path = write_random_llama(tmp_path / "t", LlamaShape(vocab_size=256, hidden_size=64, intermediate_size=96,
                                                             num_layers=2, num_heads=4, num_kv_heads=2,
                                                             max_position_embeddings=128), dtype="bfloat16", seed=4,
                                  std=0.1)
    else:
        path = tmp_path / "d"
        write_deepseek(path, seed=7, num_hidden_layers=2)
    monkeypatch.setattr(linear, "use_triton", lambda x: True)  # the linears' GPU route, interpreted
    fused = []
    original = linear.ShardedLinear.forward_normed

    def counted(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        fused.append(out[2] is None)  # (the GEMV applied the norm: no normalised row kept)
        return out

    monkeypatch.setattr(linear.ShardedLinear, "forward_normed", counted)
    routed = []
    original_router = NoAuxRouter.logits_normed

    def counted_router(self, *args, **kwargs):
        out = original_router(self, *args, **kwargs)
        routed.append(out is not None)
        return out

    monkeypatch.setattr(NoAuxRouter, "logits_normed", counted_router)
    prompt = random_prompt(3, 4, vocab=256)
    tokens = prompt + random_prompt(4, 2, vocab=256)
    logits = {}
    with LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", page_size=4)) as eng:
        gen = torch.Generator().manual_seed(1)
        for layer in eng.executor.runner.model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.data = (torch.rand(norm.weight.shape, generator=gen) + 0.5).to(norm.weight.dtype)
        for on in (True, False):
            monkeypatch.setattr(fast_path, "FUSE_INPUT_NORMS", on)
            fused.clear()
            routed.clear()
            logits[on] = _teacher_forced(eng, tokens, len(prompt))
            layers = eng.executor.runner.model.model.layers
            steps = len(tokens) - len(prompt) if on else 0
            # layers 1.. at each one-row step (layer 0 has no residual yet; prompts are several rows) ...
            assert fused.count(True) == (len(layers) - 1) * steps
            # ... and every MoE layer's post-attention norm, inside its router's launch
            assert routed.count(True) == sum(isinstance(layer.mlp, MoE) for layer in layers) * steps
    # (the same roundings: equal here; a mean square summed in another order may move an ulp. Dropping the norm's
    # weight from the fused product gives ~0.08)
    assert norm_rel_err(logits[True], logits[False]) < 1e-3


def test_the_norm_goes_into_the_gemv_only_where_each_programs_rereading_is_small(monkeypatch):
    """norm_gemv_config's rule (activation.fold_norm): at one bf16 row, V2-Lite's fused q/kv_a (912 programs x 2048
    columns) applies the norm; the 8B's qkv (1536 x 4096) and Kimi's q_a/kv_a (528 x 7168) run the norm first, as do
    two rows, float32, a residual unlike h and the switch off."""
    monkeypatch.setattr(linear, "use_triton", lambda x: True)

    def config(k, n, rows=1, dtype=torch.bfloat16, residual_dtype=None):
        h = torch.zeros(rows, k, dtype=dtype)
        residual = torch.zeros(rows, k, dtype=residual_dtype or dtype)
        return linear.norm_gemv_config(h, residual, torch.ones(k, dtype=dtype), torch.empty(n, k, dtype=dtype))

    assert config(2048, 16 * 192 + 576) is not None
    assert config(4096, 6144) is None and config(7168, 1536 + 576) is None
    assert config(2048, 3648, rows=2) is None and config(2048, 3648, dtype=torch.float32) is None
    assert config(2048, 3648, residual_dtype=torch.float32) is None
    monkeypatch.setattr(fast_path, "FUSE_INPUT_NORMS", False)
    assert config(2048, 3648) is None
    with pytest.raises(TypeError, match="row-parallel"):
        linear.RowParallelLinear(8, 8).forward_normed(torch.zeros(1, 8), torch.zeros(1, 8), None)
