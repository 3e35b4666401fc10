"""MLA's fused input projection (tandem/layers/mla_qkv_a.py): one product of the attention input per layer
where q_proj / q_a_proj and kv_a_proj_with_mqa can share a weight (unquantized, with and without q_lora,
with biases; FP8 with q rows ending on a block), two linears where they cannot (FP8 with q rows mid-block,
q_proj beside kv_a's bias); logits against transformers in every case (FP8: on the dequantized twin), the
Triton route's in-place prologue on the fused output's column views, and each rank's shard at TP 2 against
slices of the checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from deepseek_checkpoints import write_deepseek
from helpers import assert_rel, hf_logits, manual_greedy_logits, random_prompt
from quantized_deepseek_checkpoints import write_quantized_deepseek
from tandem import distributed
from tandem.configs.model import ModelConfig
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.layers.linear import ReplicatedLinear
from tandem.layers.mla_qkv_a import QKVAProjection
from tandem.layers.quantized_linear import linear_format

VOCAB = 512
LAYERS = 3  # layer 0 dense, 1..2 MoE
BLOCK = (16, 32)  # FP8 blocks of 16 rows: q_a's 32 rows end on one, 24 rows do not


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-qkv-a")
    out = {}
    variants = {"q_lora": {}, "no_q_lora": dict(q_lora_rank=None), "bias-q_lora": dict(attention_bias=True),
                "bias-no_q_lora": dict(q_lora_rank=None, attention_bias=True)}
    for i, (name, kw) in enumerate(variants.items()):
        hf = write_deepseek(root / name, seed=41 + i, num_hidden_layers=LAYERS, **kw)
        if kw.get("attention_bias"):  # transformers initialises biases to zero: make them count
            with torch.no_grad():
                for param, t in hf.named_parameters():
                    if param.endswith(".bias"):
                        t.normal_(0, 0.1)
            hf.save_pretrained(root / name, safe_serialization=True)
        out[name] = (root / name, hf)
    for rank in (32, 24):
        write_deepseek(root / f"src{rank}", seed=43, num_hidden_layers=LAYERS, q_lora_rank=rank)
        write_quantized_deepseek(root / f"src{rank}", root / f"fp8-q{rank}", root / f"fp8-q{rank}-twin", "fp8",
                                 block=BLOCK)
        out[f"fp8-q{rank}"] = (root / f"fp8-q{rank}", _hf(root / f"fp8-q{rank}-twin"))
    return out


def _hf(path):
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager").eval()


def products_of_attention_input(model, run) -> list[int]:
    """``run()``, counting per layer call the F.linear products whose input is the attention's ``x`` (its input norm's
    output: the layer may compute the first projection itself, PreNormLayer)."""
    calls: list[list] = []  # [x, products]

    def normed(mod, args, out):
        calls.append([out[0] if isinstance(out, tuple) else out, 0])

    hooks = [layer.input_layernorm.register_forward_hook(normed) for layer in model.model.layers]
    original = F.linear

    def counted(x, *args, **kwargs):
        for call in calls:
            call[1] += x is call[0]
        return original(x, *args, **kwargs)

    F.linear = counted
    try:
        run()
    finally:
        F.linear = original
        for hook in hooks:
            hook.remove()
    return [n for _, n in calls]


# attention_bias: q_a_proj's bias and kv_a's concatenate; transformers' q_proj has none, so it stays apart
@pytest.mark.parametrize("name, fused", [("q_lora", True), ("no_q_lora", True), ("bias-q_lora", True),
                                         ("bias-no_q_lora", False), ("fp8-q32", True), ("fp8-q24", False)])
def test_one_product_of_x_where_fusable_and_logits_match_hf(folders, name, fused):
    path, hf = folders[name]
    prompt = random_prompt(50, 30, VOCAB)
    with LLMEngine(EngineConfig(model=str(path), page_size=8)) as eng:
        model = eng.executor.runner.model
        out = {}
        counts = products_of_attention_input(model, lambda: out.update(prompt=eng.prompt_logits(prompt)))
        tokens, out["decode"] = manual_greedy_logits(eng, random_prompt(51, 9, VOCAB), 6)
    assert len(counts) >= LAYERS and set(counts) == {1 if fused else 2}
    for layer in model.model.layers:
        attn = layer.self_attn
        assert isinstance(attn.fused_qkv_a_proj_with_mqa, QKVAProjection) == fused
        q_name = "q_proj" if name.endswith("no_q_lora") else "q_a_proj"
        assert hasattr(attn, "kv_a_proj_with_mqa") != fused and hasattr(attn, q_name) != fused
        if name.startswith("fp8"):
            proj = attn.fused_qkv_a_proj_with_mqa if fused else attn.q_a_proj
            assert proj.weight.dtype == torch.float8_e4m3fn
    if name == "fp8-q24":
        assert isinstance(attn.q_a_proj, ReplicatedLinear) and attn.q_a_proj.weight_scale_inv.shape == (2, 2)
    assert_rel(out["prompt"], hf_logits(hf, prompt), 1e-4, "prompt")
    assert_rel(out["decode"], hf_logits(hf, tokens)[8:], 1e-4, "decode")


def test_triton_route_prologue_writes_into_the_fused_views(folders, monkeypatch):
    """Without q_lora both q and kv_a are column views of one product; the prologue (interpreted: its own kernel
    for prompts, inside absorb_q's launch for decode) rotates and normalises them in place."""
    from tandem.kernels import mla_prologue

    launches = []
    original = mla_prologue.mla_prologue

    def counted(q, kv_a, *args):
        launches.append((q.shape[0], q.stride(0), kv_a.stride(0)))
        return original(q, kv_a, *args)

    monkeypatch.setattr(mla_prologue, "mla_prologue", counted)
    from tandem.kernels import mla_absorb

    inside_absorb, original_absorb = [], mla_absorb.absorb_q

    def counted_absorb(q, w_uk, kv_lora, prologue=None):
        if prologue is not None:  # (decode: the prologue inside absorb_q's launch)
            inside_absorb.append((q.stride(0), prologue.kv_a.stride(0)))
        return original_absorb(q, w_uk, kv_lora, prologue)

    monkeypatch.setattr(mla_absorb, "absorb_q", counted_absorb)
    path, hf = folders["no_q_lora"]
    prompt = random_prompt(52, 21, VOCAB)
    with LLMEngine(EngineConfig(model=str(path), page_size=4, attention_backend="triton")) as eng:
        assert eng.executor.runner.backend.name == "triton-mla"
        assert_rel(eng.prompt_logits(prompt), hf_logits(hf, prompt), 1e-4, "prompt")
        tokens, decode = manual_greedy_logits(eng, random_prompt(53, 9, VOCAB), 4)
    assert_rel(decode, hf_logits(hf, tokens)[8:], 1e-4, "decode")
    m = ModelConfig.from_dir(path).mla
    width = 8 * m.qk_head_dim + m.cache_dim  # 8 heads' q, then kv_a: rows of the one product
    # the views themselves, not copies (a view of one row may record any row stride)
    assert {(q_stride, kv_stride) for rows, q_stride, kv_stride in launches if rows > 1} == {(width, width)}
    assert {kv_stride for _, _, kv_stride in launches} == {width}
    assert inside_absorb and {kv_stride for _, kv_stride in inside_absorb} == {width}


@pytest.mark.parametrize("name", ["no_q_lora", "fp8-q32"])
def test_tp2_shards_are_q_slices_then_the_whole_kv_a(folders, name, monkeypatch):
    """At TP 2 each rank's weight is [its slice of q_proj (by heads) or all of q_a_proj ; all of kv_a]
    (FP8: dequantized, against the twin's float32 tensors)."""
    path = folders[name][0]
    cfg = ModelConfig.from_dir(path)
    tensors = load_file(str(path / "model.safetensors"))
    dense = load_file(str(path.parent / f"{path.name}-twin" / "model.safetensors")) if name.startswith("fp8") \
        else tensors
    p = "model.layers.1.self_attn."
    q_name = "q_proj" if cfg.mla.q_lora_rank is None else "q_a_proj"
    q_size = dense[p + q_name + ".weight"].shape[0]
    for rank in range(2):
        monkeypatch.setattr(distributed, "_GROUP", distributed.TPGroup(rank=rank, size=2))
        proj = QKVAProjection(cfg.hidden_size, q_size, cfg.mla.cache_dim, q_name == "q_proj",
                              quant=linear_format(cfg.quantization, p, (q_name, "kv_a_proj_with_mqa")))
        for part, shard in ((q_name, "q"), ("kv_a_proj_with_mqa", "kv")):
            for key, t in tensors.items():
                if key.startswith(f"{p}{part}."):
                    proj.load_weight(key.rpartition(".")[2], t, shard)
        q = dense[p + q_name + ".weight"]
        want = torch.cat([q.chunk(2)[rank] if q_name == "q_proj" else q, dense[p + "kv_a_proj_with_mqa.weight"]])
        got = proj.weight if proj.quant is None else proj.quant.dequantize(proj, torch.float32)
        assert torch.equal(got, want)
        x = torch.randn(3, cfg.hidden_size)
        q_out, kv_out = proj(x)
        assert q_out.shape == (3, want.shape[0] - cfg.mla.cache_dim) and kv_out.shape == (3, cfg.mla.cache_dim)
        assert_rel(torch.cat([q_out, kv_out], -1), x @ want.T, 1e-5, "product")
