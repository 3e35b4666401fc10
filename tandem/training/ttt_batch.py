"""One TTT training batch: the teacher's outputs as padded tensors, and the K-step loss over them.

The loss is written with dense masked sums (no boolean indexing, no host syncs) so the same function
runs eagerly or under ``torch.compile`` with static shapes (batches padded to one length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.training.data import Sample


@dataclass
class TTTBatch:
    tokens: torch.Tensor  # int64 [B, T] target ids, right-padded with 0
    features: torch.Tensor  # [B, T, 3·H_t] target features
    target_p: torch.Tensor  # [B, T + K, Vd] target distribution over the draft vocabulary, renormalised
    target_id: torch.Tensor  # int64 [B, T + K] target argmax as a draft id (-1: outside the draft vocab)
    mask: torch.Tensor  # bool [B, T + K] positions whose target distribution is learned
    num_tokens: int  # real (unpadded) tokens


def make_batch(samples: list[Sample], teach, used: torch.Tensor, t2d_index: torch.Tensor, steps: int,
               include_prompt: bool, device, pad_to: int | None = None) -> TTTBatch:
    """Position p of a sequence carries the target's prediction of x_{p+1}; it is learned when x_{p+1}
    is a response token (or always, with ``include_prompt``) and the target's argmax is in the draft
    vocabulary (the draft could never propose it otherwise: EAGLE-3's and SpecForge's mask).

    ``teach``: per sample (features [n or n-1, 3·H], target) where the target is the teacher's logits
    [n, V] or, for served traffic, the next token ids [n-1] (x_1..x_{n-1}). Cross-entropy against a
    token drawn from the target's distribution is an unbiased estimate of the soft loss (at
    temperature 0 it is the argmax itself)."""
    B = len(samples)
    T = max(pad_to or 0, max(len(s.tokens) for s in samples))
    # Built where the head trains: for a large target the logits are big ([n, vocab] per sequence),
    # so they are reduced to the draft vocabulary on their own device, never copied to the host.
    used, t2d_index = used.to(device), t2d_index.to(device)
    tokens = torch.zeros(B, T, dtype=torch.int64, device=device)
    features = torch.zeros(B, T, teach[0][0].shape[-1], device=device)
    target_p = torch.zeros(B, T + steps, len(used), device=device)  # padded right: every step slices T-1 rows
    target_id = torch.full((B, T + steps), -1, dtype=torch.int64, device=device)
    mask = torch.zeros(B, T + steps, dtype=torch.bool, device=device)
    for b, (s, (feats, target)) in enumerate(zip(samples, teach)):
        n = len(s.tokens)
        tokens[b, :n] = torch.tensor(s.tokens, device=device)
        features[b, : feats.shape[0]] = feats.to(device, torch.float32)
        m = target.shape[0]  # positions with a target: n online; n - 1 for served traffic (no x_n)
        if target.dim() == 2:  # the target's logits, computed online
            logits = target.to(device, torch.float32)
            target_p[b, :m] = torch.softmax(logits[:, used], dim=-1)
            target_id[b, :m] = t2d_index[logits.argmax(-1)]
        else:  # the token the target produced next (served traffic): one sample of its distribution
            ids = t2d_index[target.to(device)]
            target_id[b, :m] = ids
            target_p[b, :m] = F.one_hot(ids.clamp(min=0), len(used)).float() * (ids >= 0).unsqueeze(-1)
        # A prompt's next tokens are the user's, not the target's: served traffic teaches responses only.
        learn_prompt = include_prompt and target.dim() == 2
        mask[b, 0 if learn_prompt else len(s.prompt) - 1 : m] = True
    mask &= target_id >= 0
    return TTTBatch(tokens, features, target_p, target_id, mask, sum(len(s.tokens) for s in samples))


def ttt_loss(head, tokens, features, target_p, target_id, mask, *, steps: int, decay: float, hard: bool,
             bf16: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ (Σ_k decay^k · loss_k, loss_k [K], accuracy_k [K], counted positions [K]). Step k's row t
    predicts position p = t + k + 1 (see DenseEagle3.ttt)."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        step_logits = head.ttt(tokens, features, steps)
    total = torch.zeros((), device=tokens.device)
    losses, accs, counts = [], [], []
    for k, logits in enumerate(step_logits):
        rows = slice(k + 1, k + 1 + logits.shape[1])
        m = mask[:, rows].float()
        n = m.sum()
        logp = F.log_softmax(logits.float(), dim=-1)  # [B, R, Vd]
        ids = target_id[:, rows]
        if hard:
            per_row = -logp.gather(-1, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        else:  # soft cross-entropy against the target's distribution
            per_row = -(target_p[:, rows] * logp).sum(-1)
        loss_k = (per_row * m).sum() / n.clamp(min=1)
        acc_k = ((logp.argmax(-1) == ids).float() * m).sum() / n.clamp(min=1)
        total = total + decay**k * loss_k
        losses.append(loss_k)
        accs.append(acc_k)
        counts.append(n)
    return total, torch.stack(losses), torch.stack(accs), torch.stack(counts)
