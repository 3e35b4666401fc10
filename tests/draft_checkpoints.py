"""Test support for EAGLE-3 drafts: a tiny target + random draft pair, checkpoint surgery for the
validation tests, and an independent dense reference of the head.

The reference shares no code with tandem: it reads the safetensors file directly and runs plain
HF-style Llama attention (transformers' own rotary) over whole contiguous sequences — no paging, no
KV cache, no fused projections — so it checks the paged, cached, batched drafter from outside.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tandem.configs.model import ModelConfig
from tandem.models.eagle3_checkpoint import write_random_eagle3

TARGET_LAYERS = 6
# The drafts name their layers (the 6-layer default [2, 3, 3] repeats one), which also exercises the
# convention: outputs of layers 0, 2, 3 = inputs (our capture indices) of layers 1, 3, 4.
AUX_IDS = (0, 2, 3)


def make_draft(path: Path, target: ModelConfig, draft_vocab: int = 200, seed: int = 0, **overrides):
    overrides.setdefault("aux_layer_ids", AUX_IDS)
    return write_random_eagle3(path, target, draft_vocab, seed=seed, token_subset="random", **overrides)


def write_pair(root: Path, target_seed: int = 11, draft_seed: int = 2) -> ModelConfig:
    """A tiny 6-layer Llama at ``root/target`` and a random draft for it at ``root/draft`` (the default seeds
    are the service tests' pair) → the target's config."""
    from checkpoints import write_checkpoint

    write_checkpoint(Path(root) / "target", "llama", seed=target_seed, num_hidden_layers=TARGET_LAYERS)
    target = ModelConfig.from_dir(Path(root) / "target")
    make_draft(Path(root) / "draft", target, seed=draft_seed)
    return target


def design_tensor_shapes(h: int, h_target: int, q: int, kv: int, inter: int, draft_vocab: int,
                         vocab: int) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes of an EAGLE-3 head (docs/architecture.md, "Contracts"), written out
    independently of the code."""
    return {
        "fc.weight": (h, 3 * h_target),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (draft_vocab, h),
        "d2t": (draft_vocab,),
        "t2d": (vocab,),
    }


def target_embedding(target_dir: Path) -> torch.Tensor:
    return load_file(str(Path(target_dir) / "model.safetensors"))["model.embed_tokens.weight"]


@dataclass(frozen=True)
class Pair:
    target_dir: Path
    draft_dir: Path
    target: ModelConfig
    draft: object  # DraftConfig
    embed: torch.Tensor  # the target's embedding [vocab, H]
    hf: object  # the transformers target model


_PAIRS: dict[int, Pair] = {}


def shared_pair(checkpoint, tmp_path_factory, seed: int = 0) -> Pair:
    """The session's 6-layer tiny Llama (conftest's ``checkpoint`` fixture) and one random draft for it."""
    if seed not in _PAIRS:
        ckpt = checkpoint("llama", seed=seed, num_hidden_layers=TARGET_LAYERS)
        target_dir = Path(ckpt.path)
        target = ModelConfig.from_dir(target_dir)
        draft_dir = tmp_path_factory.mktemp(f"eagle3_draft{seed}")
        draft = make_draft(draft_dir, target, seed=seed)
        _PAIRS[seed] = Pair(target_dir, draft_dir, target, draft, target_embedding(target_dir), ckpt.hf)
    return _PAIRS[seed]


def pair_engine(pair: Pair, spec=None, policy=None, draft_page_size: int | None = None, **engine_kw):
    """An in-process engine on ``pair``'s target, capturing the layers its draft reads, the policy off unless
    ``policy`` is given; with ``spec``, the pair's draft in process is its proposer (pages of
    ``draft_page_size``, else the engine's ``page_size``) and ``spec`` its default."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.configs.eagle3 import validate_draft
    from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
    from proposers import always_speculate

    capture = validate_draft(pair.draft, pair.target)
    eng = LLMEngine(EngineConfig(model=str(pair.target_dir), capture_layers=capture, **engine_kw),
                    policy=policy or always_speculate())
    if spec is not None:
        eng.proposer = Eagle3Drafter.from_dirs(str(pair.draft_dir), str(pair.target_dir),
                                               DrafterConfig(page_size=draft_page_size or engine_kw["page_size"]),
                                               capture_layers=capture,
                                               embed_weight=eng.executor.runner.model.model.embed_tokens.weight)
        eng.default_spec = spec
    return eng


def pair_drafter(pair: Pair, page_size: int = 4, kv_pages: int = 512, page_shuffle_seed: int | None = 3):
    """A fresh in-process drafter of ``pair``'s draft head (its pages shuffled: the paged layout is exercised)."""
    from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter

    cfg = DrafterConfig(page_size=page_size, kv_pages=kv_pages, page_shuffle_seed=page_shuffle_seed)
    return Eagle3Drafter.from_dirs(str(pair.draft_dir), str(pair.target_dir), cfg)


def draft_inputs(seed: int, n: int, width: int = 192) -> tuple[list[int], torch.Tensor]:
    """``n`` seeded random tokens and ``[n, width]`` features for a drafter's extend (192: the pair's 3 x 64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist(), torch.randn(n, width, generator=g)


def rewrite_tensors(draft_dir: Path, replace: dict[str, torch.Tensor] | None = None, drop: tuple[str, ...] = ()) -> None:
    path = Path(draft_dir) / "model.safetensors"
    state = load_file(str(path))
    state.update(replace or {})
    save_file({k: v.contiguous() for k, v in state.items() if k not in drop}, str(path))


def edit_config(draft_dir: Path, **fields) -> None:
    path = Path(draft_dir) / "config.json"
    raw = json.loads(path.read_text())
    raw.update(fields)
    path.write_text(json.dumps(raw))


class DenseEagle3:
    """The EAGLE-3 head in plain torch over full sequences (float64 for a tight reference)."""

    def __init__(self, draft_dir: Path, embed: torch.Tensor):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        raw = json.loads((Path(draft_dir) / "config.json").read_text())
        self.w = {k: v.double() if v.is_floating_point() else v for k, v in load_file(str(Path(draft_dir) / "model.safetensors")).items()}
        self.embed = embed.double()
        self.heads, self.kv_heads, self.head_dim = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
        self.eps = raw["rms_norm_eps"]
        hf = LlamaConfig(hidden_size=raw["hidden_size"], num_attention_heads=self.heads, head_dim=self.head_dim,
                         rope_theta=raw["rope_theta"], rope_scaling=raw.get("rope_scaling"),
                         max_position_embeddings=raw["max_position_embeddings"])
        self.rotary = LlamaRotaryEmbedding(hf)
        d2t = self.w["d2t"]
        self.to_target = torch.arange(len(d2t)) + d2t
        self.to_draft = {int(t): d for d, t in enumerate(self.to_target.tolist())}

    def _norm(self, x, name):
        return self.w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def project(self, features: torch.Tensor) -> torch.Tensor:  # [T, 3H_t] -> [T, H]
        return F.linear(features.double(), self.w["fc.weight"], self.w.get("fc.bias"))

    def run(self, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T], H-wide hidden inputs [T, H] → (pre-norm states [T, H], draft logits [T, Vd])."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        w, T, D = self.w, len(tokens), self.head_dim
        emb = self.embed[torch.tensor(tokens)]
        x = torch.cat([self._norm(emb, "midlayer.input_layernorm.weight"), self._norm(hidden, "midlayer.hidden_norm.weight")], -1)
        q = F.linear(x, w["midlayer.self_attn.q_proj.weight"]).view(1, T, self.heads, D).transpose(1, 2)
        k = F.linear(x, w["midlayer.self_attn.k_proj.weight"]).view(1, T, self.kv_heads, D).transpose(1, 2)
        v = F.linear(x, w["midlayer.self_attn.v_proj.weight"]).view(1, T, self.kv_heads, D).transpose(1, 2)
        cos, sin = self.rotary(q, torch.arange(T).unsqueeze(0))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / D**0.5
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(T, -1)
        h = hidden + F.linear(attn, w["midlayer.self_attn.o_proj.weight"])
        y = self._norm(h, "midlayer.post_attention_layernorm.weight")
        mlp = F.linear(F.silu(F.linear(y, w["midlayer.mlp.gate_proj.weight"])) * F.linear(y, w["midlayer.mlp.up_proj.weight"]),
                       w["midlayer.mlp.down_proj.weight"])
        states = h + mlp
        return states, F.linear(self._norm(states, "norm.weight"), w["lm_head.weight"])

    def path_logprobs(self, tokens: list[int], features: torch.Tensor, path: list[int]) -> list[torch.Tensor]:
        """Extend over (tokens, features), then feed ``path`` (target ids) back one by one, each with
        the previous row's state. Returns the draft-vocab log-probs after the extend and after each
        path token: entry d scores the children of the depth-d path node."""
        toks, hidden = list(tokens) + list(path), self.project(features)
        for t in range(len(path)):  # row n-1+t's state is the input hidden of path token t
            states, _ = self.run(toks[: len(tokens) + t], hidden)
            hidden = torch.cat([hidden, states[-1:]])
        _, logits = self.run(toks, hidden)  # causal: earlier rows are unchanged by later ones
        return list(logits[len(tokens) - 1 :].log_softmax(-1))
