"""EAGLE-3 draft checkpoints in the format SGLang loads and SpecForge writes (docs/architecture.md, "Contracts").

A draft folder holds ``config.json`` (architectures ``["LlamaForCausalLMEagle3"]``) and
``model.safetensors`` with the tensor names of ``eagle3_tensor_shapes`` — no ``model.`` prefix and,
normally, no ``embed_tokens.weight`` (the head borrows the target's). Loading goes through the shared
loader, so a missing or misshaped tensor is the same one-line CheckpointError as for targets.
``write_random_eagle3`` makes a random head for any target (tests now, mechanism benchmarks later).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from tandem.safetensors_file import write_safetensors

from tandem.errors import CheckpointError
from tandem.configs.model import ModelConfig
from tandem.models.eagle3 import PACKED_WEIGHTS, Eagle3Head
from tandem.configs.eagle3 import DraftConfig, validate_draft
from tandem.models.loader import DTYPES, checkpoint_files, default_dtype, load_checkpoint

TARGET_EMBEDDING = "model.embed_tokens.weight"


def eagle3_tensor_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a draft checkpoint and its shape (``fc.bias`` only when the config says ``bias``)."""
    h, i, two_h = cfg.hidden_size, cfg.intermediate_size, 2 * cfg.hidden_size
    shapes = {
        "fc.weight": (h, cfg.feature_width),
        "midlayer.self_attn.q_proj.weight": (cfg.q_size, two_h),
        "midlayer.self_attn.k_proj.weight": (cfg.kv_size, two_h),
        "midlayer.self_attn.v_proj.weight": (cfg.kv_size, two_h),
        "midlayer.self_attn.o_proj.weight": (h, cfg.q_size),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }
    if cfg.fc_bias:
        shapes["fc.bias"] = (h,)
    return shapes


def head_state_dict(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """The head's weights under checkpoint names (fused projections split back into their parts)."""
    attn, mlp = head.midlayer.self_attn, head.midlayer.mlp
    q, k, v = attn.qkv_proj.parts()
    gate, up = mlp.gate_up_proj.parts()
    state = {
        "fc.weight": head.fc.weight,
        "midlayer.self_attn.q_proj.weight": q,
        "midlayer.self_attn.k_proj.weight": k,
        "midlayer.self_attn.v_proj.weight": v,
        "midlayer.self_attn.o_proj.weight": attn.o_proj.weight,
        "midlayer.mlp.gate_proj.weight": gate,
        "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": mlp.down_proj.weight,
        "midlayer.input_layernorm.weight": head.midlayer.input_layernorm.weight,
        "midlayer.hidden_norm.weight": head.midlayer.hidden_norm.weight,
        "midlayer.post_attention_layernorm.weight": head.midlayer.post_attention_layernorm.weight,
        "norm.weight": head.norm.weight,
        "lm_head.weight": head.lm_head.weight,
        "d2t": head.d2t,
        "t2d": head.t2d,
    }
    if head.fc.bias is not None:
        state["fc.bias"] = head.fc.bias
    if head.embed_tokens is not None:  # a head with its own embedding keeps it in its checkpoint
        state["embed_tokens.weight"] = head.embed_tokens.weight
    return state


def save_eagle3(source: Eagle3Head | dict[str, torch.Tensor], cfg: DraftConfig, out_dir: str | Path,
                config_extra: dict | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors``; a state dict must use checkpoint names exactly.
    ``config_extra``: more keys for config.json (provenance; loaders ignore them)."""
    state = head_state_dict(source) if isinstance(source, Eagle3Head) else dict(source)
    expected = eagle3_tensor_shapes(cfg)
    if "embed_tokens.weight" in state:
        expected["embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for name, shape in expected.items():
        if name not in state:
            raise CheckpointError(f"cannot save draft: tensor '{name}' is missing")
        if tuple(state[name].shape) != shape:
            raise CheckpointError(f"cannot save draft: tensor '{name}' has shape {tuple(state[name].shape)}, expected {shape}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise CheckpointError(f"cannot save draft: unexpected tensor '{extra[0]}'")
    dtype = next(k for k, v in DTYPES.items() if v == state["fc.weight"].dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # safetensors refuses views that share storage (the split fused weights): save contiguous copies.
    write_safetensors({k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}, out / "model.safetensors")
    hf = {**dataclasses.replace(cfg, dtype=dtype, model_dir=None).to_hf_dict(), **(config_extra or {})}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


def load_eagle3(
    draft_dir: str | Path,
    embed_weight: torch.Tensor | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_positions: int | None = None,
    target: ModelConfig | None = None,
    capture_layers: tuple[int, ...] | None = None,
) -> Eagle3Head:
    """Build and fill a head. ``embed_weight`` is the target's embedding ([vocab, H], shared as is);
    a checkpoint carrying its own ``embed_tokens.weight`` uses that instead. With ``target`` the
    draft is validated against it first, before any weight is read."""
    cfg = DraftConfig.from_dir(draft_dir)
    if target is not None:
        validate_draft(cfg, target, capture_layers)
    files = checkpoint_files(Path(draft_dir))
    own_embed = "embed_tokens.weight" in files
    if not own_embed and embed_weight is None:
        raise CheckpointError(f"{draft_dir}: the draft has no embed_tokens.weight; pass the target's embedding")
    with torch.device(device), default_dtype(dtype):
        head = Eagle3Head(cfg, None if own_embed else embed_weight, max_positions).eval()
    load_checkpoint(head, draft_dir, PACKED_WEIGHTS)
    if "d2t" not in files and cfg.draft_vocab_size != cfg.vocab_size:
        raise CheckpointError(f"{draft_dir}: missing tensor 'd2t' (needed when draft_vocab_size < vocab_size)")
    if "t2d" not in files:  # derive it: the target ids the draft vocabulary covers
        head.t2d.zero_()
        head.t2d[head.to_target_ids(torch.arange(cfg.draft_vocab_size, device=head.d2t.device))] = True
    return head


def load_target_embedding(target_dir: str | Path, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """The full target token embedding, read from its checkpoint (for a drafter that does not share a
    process — or a TP shard — with the target). A multimodal wrapper (Kimi-K2.5) keeps it under its
    text model's prefix."""
    files = checkpoint_files(Path(target_dir))
    name = ModelConfig.from_dir(target_dir).checkpoint_prefix + TARGET_EMBEDDING
    if name not in files:
        raise CheckpointError(f"{target_dir}: no '{name}' tensor to share with the draft head")
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name).to(device=device, dtype=dtype)


def random_draft_config(target: ModelConfig, draft_vocab_size: int | None = None, **overrides) -> DraftConfig:
    """A draft shaped like one layer of ``target`` (overrides: any DraftConfig field)."""
    cfg = DraftConfig(
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps,
        rope=target.rope,
        max_position_embeddings=target.max_position_embeddings,
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab_size or target.vocab_size,
        target_hidden_size=target.hidden_size,
        aux_layer_ids=None,
        fc_bias=False,
        dtype="float32",
    )
    return dataclasses.replace(cfg, **overrides)


def random_eagle3_state(cfg: DraftConfig, seed: int = 0, token_subset: str = "first") -> dict[str, torch.Tensor]:
    """Random float32 weights under checkpoint names. Linear weights ~ N(0, 1/fan_in) keep activations
    O(1); norms are 1 + noise so swapping two norms changes the output. ``token_subset`` picks the
    draft vocabulary: the ``first`` draft_vocab target ids or a sorted ``random`` subset."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in eagle3_tensor_shapes(cfg).items():
        if name in ("d2t", "t2d"):
            continue
        if len(shape) == 2:
            state[name] = torch.randn(shape, generator=g) * shape[1] ** -0.5
        elif name == "fc.bias":
            state[name] = torch.randn(shape, generator=g) * 0.02
        else:
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
    if token_subset == "first":
        ids = torch.arange(cfg.draft_vocab_size)
    elif token_subset == "random":
        ids = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    else:
        raise ValueError(f"token_subset must be 'first' or 'random', got '{token_subset}'")
    state["d2t"] = ids - torch.arange(cfg.draft_vocab_size)  # int64: target = draft + d2t[draft]
    state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    return state


def write_random_eagle3(
    out_dir: str | Path,
    target: ModelConfig,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    token_subset: str = "first",
    dtype: str = "float32",
    **overrides,
) -> DraftConfig:
    """Write a random EAGLE-3 head for ``target`` to ``out_dir``; returns its config."""
    cfg = random_draft_config(target, draft_vocab_size, **overrides)
    state = random_eagle3_state(cfg, seed, token_subset)
    cast = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v) for k, v in state.items()}
    save_eagle3(cast, cfg, out_dir)
    return dataclasses.replace(cfg, dtype=dtype, model_dir=str(out_dir))
