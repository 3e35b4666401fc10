"""Benchmark models: a Llama-3.1-8B-shaped target with random bf16 weights drawn on the GPU (only its
config.json is written) and a random EAGLE-3 head for it, cached in a temporary folder."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from tandem.models.random_checkpoint import LLAMA_8B, hf_config

LLAMA_8B_SHAPE = dataclasses.asdict(LLAMA_8B)
_ROOT = Path(tempfile.gettempdir()) / "tandem-bench"


def target_dir(layers: int) -> Path:
    path = _ROOT / f"llama8b-{layers}l"
    if not (path / "config.json").is_file():
        path.mkdir(parents=True, exist_ok=True)
        shape = dataclasses.replace(LLAMA_8B, num_layers=layers, max_position_embeddings=8192)
        (path / "config.json").write_text(json.dumps(hf_config(shape, "bfloat16", bos=128000, eos=128001)))
    return path


def weight_bytes_per_token(shape: dict, layers: int, dtype_bytes: int = 2) -> int:
    """Bytes of weights one decode step must read: every layer's matrices, the norms and the LM head
    (the embedding contributes one row, negligible)."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_kv_heads"] * (h // shape["num_heads"])
    per_layer = h * (h + 2 * kv) + h * h + 2 * h * i + h * i + 2 * h
    return dtype_bytes * (layers * per_layer + v * h + h)


def bench_engine(layers: int, widths: tuple[int, ...], max_bs: int, disable_graphs: bool = False):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    cfg = EngineConfig(model=str(target_dir(layers)), device="cuda", dtype="bfloat16", load_format="random",
                       cuda_graph_widths=widths, cuda_graph_max_bs=max_bs, disable_cuda_graph=disable_graphs,
                       kv_pages=6144)  # 96k tokens: 12 GB at the 8B shape, enough for 64 requests x 1.5k
    return LLMEngine(cfg)


def random_draft(target: Path, capture_layers: tuple[int, ...]) -> Path:
    from tandem.models.config import ModelConfig
    from tandem.models.eagle3_checkpoint import write_random_eagle3

    path = target.parent / (target.name + "-eagle3")
    if not (path / "config.json").is_file():
        aux = tuple(k - 1 for k in capture_layers)  # eagle ids name layer outputs: inputs of k+1
        write_random_eagle3(path, ModelConfig.from_dir(target), draft_vocab_size=32000, seed=0, dtype="bfloat16",
                            aux_layer_ids=aux)
    return path
