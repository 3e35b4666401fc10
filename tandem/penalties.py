"""vLLM's repetition, presence and frequency penalties on a request's logits.

Repetition (the CTRL rule, as transformers' RepetitionPenaltyLogitsProcessor): a token seen in the prompt
or the output has a positive logit divided by the penalty and a negative one multiplied by it. Presence
and frequency (OpenAI's): a token the output holds loses ``presence`` once and ``frequency`` per time it
occurs. The logits depend on every token before them: a speculating request's tree rows are each penalized
over their own history (the output and the draft tokens on the node's path, tandem.request_logits), so
acceptance sees what plain decoding would at every node.
"""

from __future__ import annotations

import torch

from tandem.sampling import SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``logits`` [N, V] (rows that share this history) → penalized float32 logits (a new tensor)."""
    logits = logits.float().clone()
    vocab, dev = logits.shape[-1], logits.device
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
        seen[torch.tensor(prompt + output, dtype=torch.int64, device=dev)] = True
        penalty = params.repetition_penalty
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if output and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64, device=dev), minlength=vocab)[:vocab]
        logits -= params.frequency_penalty * counts.float() + params.presence_penalty * (counts > 0).float()
    return logits
