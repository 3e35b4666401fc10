"""The engine's per-request side of sampling in a step: the rules that depend on a request's own tokens
(tandem.request_logits: penalties, min_tokens) applied to its rows before plain sampling or acceptance, and
the log-probabilities of what it emitted (tandem.logprobs) for requests that ask. Requests that use
neither cost nothing here."""

from __future__ import annotations

import torch

from tandem.engine.request import Request
from tandem.logprobs import TokenLogprobs, gather_logprobs
from tandem.request_logits import history_matters, request_logits
from tandem.sampling import sample
from tandem.speculative.tree import DraftTree


def sample_rows(logits: torch.Tensor, reqs_rows: list[tuple[Request, int]], eos_token_ids) -> list[int]:
    """One token per (request, row of ``logits``): a plain step's, or a prompt's first."""
    rows = torch.tensor([r for _, r in reqs_rows], device=logits.device)
    picked = logits[rows]
    shaped = [j for j, (req, _) in enumerate(reqs_rows) if history_matters(req.params, len(req.output))]
    if shaped:
        picked = picked.float()
        for j in shaped:
            req = reqs_rows[j][0]
            picked[j] = request_logits(picked[j : j + 1], req.params, req.prompt, req.output, eos_token_ids)[0]
    reqs = [req for req, _ in reqs_rows]
    return sample(picked, [req.params for req in reqs], [req.generator for req in reqs]).tolist()


def tree_logits(logits: torch.Tensor, req: Request, tree: DraftTree, eos_token_ids) -> torch.Tensor:
    """The rows of ``req``'s tree ([tree.size, V]) as acceptance must see them: min_tokens masks a node
    by its depth. (Penalized requests never draft: their history differs along each path.)"""
    if not history_matters(req.params, len(req.output)):
        return logits
    return request_logits(logits, req.params, req.prompt, req.output, eos_token_ids, tree.depths)


class LogprobJobs:
    """The rows and tokens whose log-probabilities a step owes its requests, computed in one pass."""

    def __init__(self):
        self.jobs: list[tuple[str, list[int], list[int], int]] = []

    def add(self, req: Request, rows: list[int], tokens: list[int]) -> None:
        if req.params.logprobs is not None:
            self.jobs.append((req.rid, rows, tokens, req.params.logprobs))

    def compute(self, logits: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        return gather_logprobs(logits, self.jobs)


def needs_host_each_step(req: Request) -> bool:
    """Whether the request's steps cannot be queued on the device ahead of the host (decode_ahead,
    rounds_ahead): its logits need its own tokens (penalties, min_tokens not reached) or its
    log-probabilities are read at each step."""
    return req.params.logprobs is not None or history_matters(req.params, len(req.output))
