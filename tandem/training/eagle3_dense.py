"""A dense, trainable twin of the EAGLE-3 head, and its training-time-test (TTT) unroll.

The serving head (``tandem.models.eagle3.Eagle3Head``) runs on paged KV with fused, frozen
projections; training needs plain ``nn.Linear`` layers, whole sequences and autograd. This twin has
exactly the checkpoint's parameter names and shapes (docs/architecture.md, "Contracts"): ``state_dict()`` is what
``save_eagle3`` writes, with no renaming. A test checks it equals the paged head on the same weights.

TTT (EAGLE-3 §3.2), written to match *our* inference exactly. Row t of a sequence x_0..x_{n-1} with
target features f_t:

- step 0 reads (embed(x_{t+1}), fc(f_t)) at rotary position t with causal attention over the step-0
  rows 0..t — what draft-extend computes — and predicts x_{t+2};
- step k ≥ 1 reads (embed(x_{t+k+1}), s^{k-1}_t), the head's own pre-norm state of the previous
  step, at position t+k, and attends to the step-0 keys of rows 0..t plus the keys of steps 1..k of
  row t itself (the "diagonal"): exactly the committed KV plus the chain's own draft nodes that the
  drafter's step k sees, at the positions the drafter gives them. It predicts x_{t+k+2}.

So each of the K steps trains what the drafter does at that depth of a chain, with the true tokens as
inputs (teacher forcing, as EAGLE-3 does; a mistaken token ends the accepted run anyway).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.rotary import inverse_frequencies
from tandem.configs.eagle3 import DraftConfig
from tandem.training.dense_llama import RMSNorm, apply_rotary


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        two_h = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(two_h, cfg.q_size, bias=False)
        self.k_proj = nn.Linear(two_h, cfg.kv_size, bias=False)
        self.v_proj = nn.Linear(two_h, cfg.kv_size, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftMidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)


class DenseEagle3(nn.Module):
    """Checkpoint-named parameters + ``d2t``/``t2d`` buffers; the target's embedding is borrowed
    (a non-persistent buffer: never trained, never saved — the served head reuses the target's)."""

    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor, max_positions: int):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.feature_width, cfg.hidden_size, bias=cfg.fc_bias)
        self.midlayer = DraftMidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("embed", embed_weight.detach().clone(), persistent=False)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inverse_frequencies(cfg.head_dim, cfg.rope))
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def init_weights(self, seed: int, target_lm_head: torch.Tensor | None = None,
                     target_norm: torch.Tensor | None = None) -> None:
        """Llama init (N(0, 0.02), norms 1). With the target's LM head and final norm, the draft
        vocabulary's rows of them start the head's own: its first steps then already speak the
        target's output space, which shortens training a lot on small budgets."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.02)
            if target_lm_head is not None:
                self.lm_head.weight.copy_(target_lm_head[self.draft_to_target()])
            if target_norm is not None:
                self.norm.weight.copy_(target_norm)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(states))

    def ttt(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens int64 [B, T] (target ids, right-padded), features [B, T, 3·H_t] → per step k, draft
        logits [B, R, draft_vocab] with R = T - 1 rows; row t of step k predicts x_{t+k+2}. Rows whose
        inputs run past a sequence's end read padding; the caller masks their loss."""
        cfg, (B, T) = self.config, tokens.shape
        R = T - 1
        D, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        rows = torch.arange(R, device=tokens.device)
        attn, mid = self.midlayer.self_attn, self.midlayer
        padded = F.pad(tokens, (0, steps))  # step k reads x_{t+k+1}: shift left, pad right
        hidden = self.fc(features[:, :R])  # [B, R, H]
        causal = rows[None, :] <= rows[:, None]  # [R, R]: row t sees rows s <= t
        k0 = v0 = None
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        out_logits = []
        for k in range(steps):
            emb = self.embed[padded[:, k + 1 : k + 1 + R]].to(hidden.dtype)
            x = torch.cat([mid.input_layernorm(emb), mid.hidden_norm(hidden)], dim=-1)  # [B, R, 2H]
            q = attn.q_proj(x).view(B, R, hq, D).transpose(1, 2)  # [B, Hq, R, D]
            kk = attn.k_proj(x).view(B, R, hkv, D).transpose(1, 2)
            vv = attn.v_proj(x).view(B, R, hkv, D).transpose(1, 2)
            cos, sin = self.cos[rows + k].to(q.dtype), self.sin[rows + k].to(q.dtype)  # positions t + k
            q, kk = apply_rotary(q, cos, sin), apply_rotary(kk, cos, sin)
            if hkv != hq:  # grouped-query attention: each kv head serves hq/hkv query heads
                kk, vv = kk.repeat_interleave(hq // hkv, dim=1), vv.repeat_interleave(hq // hkv, dim=1)
            if k == 0:
                k0, v0 = kk, vv
            else:
                diag_k.append(kk)
                diag_v.append(vv)
            scale = D**-0.5
            scores = (q @ k0.transpose(-1, -2)) * scale  # [B, Hq, R, R]
            scores = scores.masked_fill(~causal, float("-inf"))
            diag = [(q * dk).sum(-1, keepdim=True) * scale for dk in diag_k]  # each [B, Hq, R, 1]
            probs = torch.cat([scores, *diag], dim=-1).float().softmax(-1).to(q.dtype)
            out = probs[..., :R] @ v0
            for j, dv in enumerate(diag_v):
                out = out + probs[..., R + j : R + j + 1] * dv
            h = hidden + attn.o_proj(out.transpose(1, 2).reshape(B, R, hq * D))
            states = h + mid.mlp(mid.post_attention_layernorm(h))  # pre-norm [B, R, H]
            out_logits.append(self.logits(states))
            hidden = states  # the next step feeds back this step's own states
        return out_logits
