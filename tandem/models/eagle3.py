"""The EAGLE-3 draft head (SGLang's ``LlamaForCausalLMEagle3``): one Llama decoder layer whose
attention reads ``[input_layernorm(embed(token)); hidden_norm(h)]`` (2·H wide), fed either with
``fc(target features)`` (3·H_target → H, on draft-extend) or with its own pre-norm output (H wide, on
later draft steps), and an LM head over a reduced draft vocabulary mapped back by ``d2t``.

The head runs in one process without tensor parallelism — in the in-process engine that process
may be TP rank 0, so every projection is replicated (the TP-aware llama MLP/attention would shard
and all-reduce). Parameter names are the checkpoint's (docs/architecture.md, "Contracts") except the fused projections,
which ``PACKED_WEIGHTS`` maps back: ``q/k/v_proj`` → ``qkv_proj``, ``gate/up_proj`` → ``gate_up_proj``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.attention.backend import AttentionBackend, attend
from tandem.attention.metadata import AttentionMetadata
from tandem.kv_cache import KVPool
from tandem.layers.linear import ReplicatedLinear, check_shape
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.configs.eagle3 import DraftConfig

# checkpoint name fragment -> (our fused module fragment, part index); the loader's ``packed`` map
PACKED_WEIGHTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class StackedLinear(ReplicatedLinear):
    """Several projections of one input stacked into one matmul; loaded part by part."""

    def __init__(self, in_features: int, part_sizes: list[int]):
        super().__init__(in_features, sum(part_sizes))
        self.part_sizes = list(part_sizes)

    def load_weight(self, param: str, tensor: torch.Tensor, shard_id: object = None) -> None:
        part = int(shard_id)  # type: ignore[arg-type]
        size, offset = self.part_sizes[part], sum(self.part_sizes[:part])
        check_shape(tensor, (size, self.in_features))
        self.weight.data.narrow(0, offset, size).copy_(tensor)

    def parts(self) -> list[torch.Tensor]:
        return list(self.weight.data.split(self.part_sizes, dim=0))


class Embedding(nn.Module):
    """A draft's own token embedding (rare: only when the checkpoint carries embed_tokens.weight)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab_size, hidden_size), requires_grad=False)

    def load_weight(self, param: str, tensor: torch.Tensor, shard_id: object = None) -> None:
        check_shape(tensor, tuple(self.weight.shape))
        self.weight.data.copy_(tensor)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: DraftConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.cfg = cfg
        # q/k/v read the 2H-wide [embed; hidden] concatenation, o_proj writes back H.
        self.qkv_proj = StackedLinear(2 * cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size])
        self.o_proj = ReplicatedLinear(cfg.q_size, cfg.hidden_size)
        self.rotary = rotary
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, positions, meta: AttentionMetadata, kv: KVPool, backend: AttentionBackend):
        c = self.cfg
        q, k, v = self.qkv_proj(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)  # [T, Hq, D]
        k = k.view(-1, c.num_kv_heads, c.head_dim)  # [T, Hkv, D]
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        k_pool, v_pool = kv.layer(0)  # the head's pool has exactly one layer
        out = attend(backend, q, k, v, positions, self.rotary, k_pool, v_pool, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.flatten(1))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_up_proj = StackedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = ReplicatedLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), swiglu=True)  # silu(gate) * up


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the H-wide hidden
        self.self_attn = Eagle3Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, embeds, hidden, positions, meta, kv, backend) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [T, 2H]
        h = hidden + self.self_attn(x, positions, meta, kv, backend)  # residual is the un-normed hidden
        return h + self.mlp(self.post_attention_layernorm(h))  # [T, H], pre-norm


class Eagle3Head(nn.Module):
    """``forward`` → (pre-norm states [T, H], draft logits [N, draft_vocab] of the requested rows)."""

    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor | None, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, max(cfg.max_position_embeddings, max_positions or 0), cfg.rope)
        self.max_positions = rotary.cos.shape[0]
        self.fc = ReplicatedLinear(cfg.feature_width, cfg.hidden_size, bias=cfg.fc_bias)
        self.midlayer = Eagle3MidLayer(cfg, rotary)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ReplicatedLinear(cfg.hidden_size, cfg.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # target = draft + d2t
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))  # target id in draft vocab
        if embed_weight is None:
            self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)  # filled from the checkpoint
            self._shared_embed = None
        else:
            if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError(
                    f"target embedding has shape {tuple(embed_weight.shape)}, the head needs {(cfg.vocab_size, cfg.hidden_size)}"
                )
            self.embed_tokens = None
            # The target's storage itself (detach: a Parameter would register here and be expected in the checkpoint).
            self._shared_embed = embed_weight.detach()

    @property
    def shared_embedding(self) -> torch.Tensor | None:
        """The target's embedding this head borrows (None when the draft has its own)."""
        return self._shared_embed

    @property
    def embed_weight(self) -> torch.Tensor:
        return self._shared_embed if self._shared_embed is not None else self.embed_tokens.weight

    def load_weight(self, param: str, tensor: torch.Tensor, shard_id: object = None) -> None:
        """The loader's hook for the top-level buffers ``d2t`` and ``t2d``."""
        buf = getattr(self, param)
        check_shape(tensor, tuple(buf.shape))
        buf.copy_(tensor.to(buf.dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(
        self,
        token_ids: torch.Tensor,  # int64 [T], target ids
        hidden: torch.Tensor,  # [T, 3·H_target] target features, or [T, H] the head's own pre-norm states
        positions: torch.Tensor,  # int64 [T]
        meta: AttentionMetadata,
        kv: KVPool,
        backend: AttentionBackend,
        logits_indices: torch.Tensor | None = None,  # int64 [N]; None = no logits
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if hidden.shape[-1] == self.fc.in_features:
            hidden = self.fc(hidden)  # draft-extend: project the captured target features
        elif hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"draft input is {hidden.shape[-1]} wide; expected {self.fc.in_features} (target features) "
                f"or {self.config.hidden_size} (draft states)"
            )
        embeds = F.embedding(token_ids, self.embed_weight).to(hidden.dtype)  # [T, H]
        states = self.midlayer(embeds, hidden, positions, meta, kv, backend)  # [T, H]
        logits = self.logits(states[logits_indices]) if logits_indices is not None else None
        return states, logits

    def logits(self, states: torch.Tensor) -> torch.Tensor:  # [N, H] -> float32 [N, draft_vocab]
        return self.logits_in_model_dtype(states).float()

    def logits_in_model_dtype(self, states: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, draft_vocab]
        """For kernels that read the logits once and widen them as they go (tandem/kernels/chain_pick.py)."""
        return self.lm_head(self.norm(states))
