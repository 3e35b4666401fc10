"""Log-probabilities of generated tokens, as vLLM returns them by default: the log-softmax of the target's
raw logits (before penalties, temperature, min-p, top-k, top-p) at the position that produced the token,
with the ``n`` most likely alternatives. Computed only for the rows of requests that ask, from the logits
the verify or decode forward already returned."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # the generated token's
    top: tuple[tuple[int, float], ...]  # the most likely tokens and theirs, most likely first
    # its rank over the vocabulary as vLLM counts it (tokens at least as likely, itself included: 1 the most likely);
    # None where not computed (runs queued on the device)
    rank: int | None = None


Job = tuple[Hashable, Sequence[int], Sequence[int], int]  # key, rows, tokens, alternatives wanted


def gather_logprobs(logits: torch.Tensor, jobs: Sequence[Job]) -> dict[Hashable, list[TokenLogprobs]]:
    """``jobs``: (key, rows of ``logits`` [R, V], the token generated at each row, alternatives wanted)
    → key → one TokenLogprobs per row. One pass over every job's rows and one read-back."""
    if not jobs:
        return {}
    rows = [r for _, job_rows, _, _ in jobs for r in job_rows]
    tokens = [t for _, _, job_tokens, _ in jobs for t in job_tokens]
    dev = logits.device
    logp = logits[torch.tensor(rows, device=dev)].float().log_softmax(dim=-1)
    chosen_t = logp.gather(1, torch.tensor(tokens, device=dev).unsqueeze(1))
    ranks = (logp >= chosen_t).sum(dim=-1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    most = min(max(k for _, _, _, k in jobs), logp.shape[-1])
    top_values, top_ids = (logp.topk(most, dim=-1) if most else (logp[:, :0], logp[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out, i = {}, 0
    for key, job_rows, _, k in jobs:
        out[key] = [TokenLogprobs(chosen[j], tuple(zip(top_ids[j][:k], top_values[j][:k])), ranks[j])
                    for j in range(i, i + len(job_rows))]
        i += len(job_rows)
    return out
