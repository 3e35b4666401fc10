"""Benchmark models: a Llama-3.1-8B-shaped target with random bf16 weights drawn on the GPU (only its
config.json is written) and a random EAGLE-3 head for it, cached in a temporary folder."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from quant_schemes import MatrixBytes, dense_bytes
from tandem.models.random_checkpoint import LLAMA_8B, hf_config

LLAMA_8B_SHAPE = dataclasses.asdict(LLAMA_8B)
LLAMA_70B = dataclasses.replace(LLAMA_8B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                                num_kv_heads=8)
LLAMA_70B_SHAPE = dataclasses.asdict(LLAMA_70B)
_ROOT = Path(tempfile.gettempdir()) / "tandem-bench"


BENCH_CONTEXT = 8192  # positions the benchmark targets serve unless a section needs more


def target_dir(layers: int, base=LLAMA_8B, name: str = "llama8b", context: int = BENCH_CONTEXT,
               extra: dict | None = None) -> Path:
    """A config-only LlamaForCausalLM folder (weights drawn at load); ``extra``: more config.json fields
    (a ``quantization_config``), which ``name`` must tell apart."""
    path = _ROOT / (f"{name}-{layers}l" if context == BENCH_CONTEXT else f"{name}-{layers}l-{context}")
    if not (path / "config.json").is_file():
        path.mkdir(parents=True, exist_ok=True)
        shape = dataclasses.replace(base, num_layers=layers, max_position_embeddings=context)
        config = {**hf_config(shape, "bfloat16", bos=128000, eos=128001), **(extra or {})}
        (path / "config.json").write_text(json.dumps(config))
    return path


def weight_bytes_per_token(shape: dict, layers: int, dtype_bytes: int = 2, linear: MatrixBytes | None = None) -> int:
    """Bytes of weights one decode step must read: every layer's matrices (``linear``: the bytes of one
    [rows, cols] projection in the target's format, bf16 by default; the engine's fused qkv and gate/up
    as one matrix each), the norms and the LM head (the embedding contributes one row, negligible)."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_kv_heads"] * (h // shape["num_heads"])
    matrix = linear or dense_bytes(dtype_bytes)
    per_layer = matrix(h + 2 * kv, h) + matrix(h, h) + matrix(2 * i, h) + matrix(h, i) + dtype_bytes * 2 * h
    return layers * per_layer + dtype_bytes * (v * h + h)


def bench_engine(layers: int, widths: tuple[int, ...], max_bs: int, disable_graphs: bool = False):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    from tandem.speculative.policy import PolicyConfig, SpeculationPolicy

    cfg = EngineConfig(model=str(target_dir(layers)), device="cuda", dtype="bfloat16", load_format="random",
                       cuda_graph_widths=widths, cuda_graph_max_bs=max_bs, disable_cuda_graph=disable_graphs,
                       kv_pages=6144,  # 96k tokens: 12 GB at the 8B shape, enough for 64 requests x 1.5k
                       # The controlled-acceptance runs replay the same prompts: from the prefix cache the first
                       # token comes from a short chunk whose bf16 rounding differs, and the random target's
                       # near-ties then leave the reference (on the H200: τ 1.0-1.06 at every goal, 2026-12-02).
                       enable_prefix_caching=False)
    # Every round speculates: the controlled-acceptance runs measure speculation itself (sections that measure
    # the policy set their own).
    engine = LLMEngine(cfg, policy=SpeculationPolicy(PolicyConfig(enabled=False)))
    sharpen_greedy(engine.executor.runner.model)
    return engine


def sharpen_greedy(model, scale: float = 1000.0, seed: int = 0) -> None:
    """Give a random target a greedy continuation with wide margins, so that no kernel's bf16 rounding (another
    batch size, verify width, a plain step's graph) can change it and the controlled-acceptance instrument's
    reference holds whatever the policy picks. The embedding is scaled until it dominates the residual stream
    and the LM head reads the embedding of a permuted token: greedy after token x is perm(x), by a margin of
    ~sqrt(hidden) over any other logit. Shapes, kernels and therefore timings are unchanged."""
    import torch

    embed = model.model.embed_tokens.weight
    if model.lm_head.weight.data_ptr() == embed.data_ptr():
        return  # tied: the head cannot read another token's row
    with torch.no_grad():
        embed.mul_(scale)
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(embed.shape[0], generator=g).to(embed.device)
        # lm_head[perm[x]] = embed[x]: the logit of perm(x) is embed[x] . embed[x]
        model.lm_head.weight.index_copy_(0, perm, embed)


def bench_engine_for(shape: dict, layers: int, tp_size: int):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    base = LLAMA_70B if shape["hidden_size"] == 8192 else LLAMA_8B
    tdir = target_dir(layers, base, "llama70b" if base is LLAMA_70B else "llama8b")
    return LLMEngine(EngineConfig(model=str(tdir), device="cuda", dtype="bfloat16", load_format="random",
                                  tp_size=tp_size, cuda_graph_max_bs=8, kv_pages=2048))


def random_draft(target: Path, capture_layers: tuple[int, ...]) -> Path:
    from tandem.configs.model import ModelConfig
    from tandem.models.eagle3_checkpoint import write_random_eagle3

    path = target.parent / (target.name + "-eagle3")
    if not (path / "config.json").is_file():
        aux = tuple(k - 1 for k in capture_layers)  # eagle ids name layer outputs: inputs of k+1
        write_random_eagle3(path, ModelConfig.from_dir(target), draft_vocab_size=32000, seed=0, dtype="bfloat16",
                            aux_layer_ids=aux)
    return path


def bench_drafter(engine, layers: int, specs: list, max_bs: int = 8):
    """A random bf16 EAGLE-3 head for ``bench_engine(layers, ...)``, sharing the target's embedding and,
    with graphs on, capturing its draft graphs for ``specs`` up to batch ``max_bs`` in the target's pool;
    → (drafter, capture report or None)."""
    from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter

    runner = engine.executor.runner
    graphs = runner.graphs is not None
    drafter = Eagle3Drafter.from_dirs(str(random_draft(target_dir(layers), runner.capture_layers)), str(target_dir(layers)),
                                      DrafterConfig(device="cuda", dtype="bfloat16", cuda_graph_max_bs=max_bs,
                                                    disable_cuda_graph=not graphs, defer_chain_tokens=True),
                                      capture_layers=runner.capture_layers,
                                      embed_weight=runner.model.model.embed_tokens.weight)
    report = drafter.capture_cuda_graphs(specs, pool=runner.graphs.pool) if graphs else None
    return drafter, report


ROOT_DIR = Path(__file__).resolve().parent.parent




def write_target_embedding(folder: Path) -> None:
    """The random 8B-shaped target's embedding on disk: a drafter process reads the target's embedding
    from its folder (the verifier draws its weights on the device)."""
    import torch
    from safetensors.torch import save_file

    if not (Path(folder) / "model.safetensors").exists():
        emb = torch.randn(LLAMA_8B_SHAPE["vocab_size"], LLAMA_8B_SHAPE["hidden_size"], dtype=torch.bfloat16) * 0.02
        save_file({"model.embed_tokens.weight": emb}, str(Path(folder) / "model.safetensors"))


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tokenizer.json whose every id is a word ("t123"), so that the gateway can serve a random-weight
    model: prompts go in as token ids, completions come out as words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(folder) / "tokenizer.json"
    if path.is_file():
        return
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
