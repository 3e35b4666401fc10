"""The rules that make a request's logits depend on its own tokens: penalties (tandem.penalties) and
``min_tokens``, which masks the stop tokens (EOS unless ignored, and ``stop_token_ids``) while fewer than
``min_tokens`` tokens are generated. Plain sampling and speculative acceptance both sample from the logits
these rules return, so a rule changes the target's distribution the same way on either path.

Inside a draft tree, a node at depth d decides the request's output token number ``produced + d``; its row
is masked while ``produced + d < min_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.penalties import apply_penalties
from tandem.sampling import SamplingParams


def history_matters(params: SamplingParams, produced: int) -> bool:
    """Whether the request's next logits need ``request_logits`` (else they are the target's as they are)."""
    return params.penalized or produced < params.min_tokens


def request_logits(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                   eos_token_ids: Sequence[int], paths: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """``logits`` [N, V]: row i decides the output token after ``output + paths[i]`` — the draft tokens on
    its path (paths: all empty by default: rows that share the output as their history) → float32 logits
    after the penalties (over each row's own history) and the ``min_tokens`` mask (by each row's depth)."""
    if params.penalized:
        if paths is None or not any(paths):
            logits = apply_penalties(logits, params, prompt, output)
        else:
            logits = torch.cat([apply_penalties(logits[i : i + 1], params, prompt, output + list(path))
                                for i, path in enumerate(paths)])
    produced = len(output)
    if produced >= params.min_tokens:
        return logits
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    stops = sorted(t for t in stops if 0 <= t < logits.shape[-1])
    if not stops:
        return logits
    depth = torch.tensor([len(p) for p in paths] if paths is not None else [0] * logits.shape[0],
                         device=logits.device)
    early = (produced + depth < params.min_tokens).unsqueeze(1)
    logits = logits.float().clone()
    logits[:, stops] = torch.where(early, float("-inf"), logits[:, stops])
    return logits
