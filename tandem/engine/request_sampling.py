"""The engine's per-request side of sampling in a step: the rules that depend on a request's own tokens
(tandem.request_logits: penalties, min_tokens) applied to its rows before plain sampling or acceptance, and
the log-probabilities of what it emitted (tandem.logprobs) for requests that ask. Requests that use
neither cost nothing here."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.engine.request import Request
from tandem.staging import HostReadback, upload
from tandem.logprobs import TokenLogprobs, gather_logprobs
from tandem.request_logits import history_matters, request_logits
from tandem.sampling import adjusted_probs, sample
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
    return sample(picked, [req.params for req in reqs], [(req.seed, req.num_tokens) for req in reqs]).tolist()


def tree_logits(logits: torch.Tensor, req: Request, tree: DraftTree, eos_token_ids) -> torch.Tensor:
    """The rows of ``req``'s tree ([tree.size, V]) as acceptance must see them: each node's row after the
    penalties over its own history (the output and the draft tokens on its path) and min_tokens by its depth."""
    if not history_matters(req.params, len(req.output)):
        return logits
    paths = [[tree.tokens[n] for n in tree.path_to(node)] for node in range(tree.size)]
    return request_logits(logits, req.params, req.prompt, req.output, eos_token_ids, paths)


class LogprobJobs:
    """The rows and tokens whose log-probabilities a step owes its requests, computed in one pass.
    ``processed_eos``: the target's EOS ids when logprobs are processed (``--logprobs-mode
    processed_logprobs``: each request's rows as it samples from them, ``processed_logits``), else None."""

    def __init__(self, jobs: list | None = None, processed_eos: Sequence[int] | None = None):
        self.jobs: list[tuple[str, list[int], list[int], int]] = jobs or []
        self.processed_eos = processed_eos
        self._reqs: dict[str, Request] = {}

    def add(self, req: Request, rows: list[int], tokens: list[int]) -> None:
        """``rows``: the request's path, one row per depth from 0 (a plain step's one row)."""
        if req.params.logprobs is not None:
            self.jobs.append((req.rid, rows, tokens, req.params.logprobs))
            self._reqs[req.rid] = req

    def compute(self, logits: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        if self.processed_eos is None or not self.jobs:
            return gather_logprobs(logits, self.jobs)
        blocks, jobs, at = [], [], 0
        for rid, rows, tokens, k in self.jobs:
            rows_logits = logits[torch.tensor(rows, device=logits.device)]
            blocks.append(processed_logits(rows_logits, self._reqs[rid], tokens, self.processed_eos))
            jobs.append((rid, list(range(at, at + len(rows))), tokens, k))
            at += len(rows)
        # (the log of a distribution is its own log-softmax: gather_logprobs leaves it as it is)
        return gather_logprobs(torch.cat(blocks), jobs)


def processed_logits(logits: torch.Tensor, req: Request, tokens: list[int], eos_token_ids: Sequence[int]) -> torch.Tensor:
    """``logits`` [n, V]: the request's rows along its emitted ``tokens`` (row d decides tokens[d], after
    tokens[:d]) → the log of the distribution it samples from there (penalties and min_tokens, then
    temperature, min_p, top-k, top-p; a greedy request's after penalties and min_tokens only), -inf where a
    token cannot be drawn."""
    x = logits.float()
    if history_matters(req.params, len(req.output)):
        x = request_logits(x, req.params, req.prompt, req.output, eos_token_ids,
                           [tokens[:d] for d in range(x.shape[0])])
    if req.params.greedy:
        return x.log_softmax(dim=-1)
    return adjusted_probs(x, [req.params] * x.shape[0]).log()


def needs_host_each_round(req: Request, processed_logprobs: bool = False) -> bool:
    """Whether the request keeps its batch out of chain rounds queued on the device (rounds_ahead): its
    logits need its own tokens (penalties, min_tokens not reached: each node's own path, on the host), or its
    logprobs are processed ones (``processed_logprobs``), which runs do not record."""
    return history_matters(req.params, len(req.output)) or (processed_logprobs and req.params.logprobs is not None)


class RunLogprobs:
    """Log-probabilities in a run queued on the device — decode steps (tandem.engine.decode_ahead) or
    greedy chain rounds (tandem.speculative.chain_rounds, ``width`` nodes a round) — for the requests of
    the run that ask: each step records its rows' raw log-softmax at the token each node emits and the top
    N into device buffers, without waiting; the buffers come back with the run's tokens."""

    def __init__(self, reqs: list, steps: int, device: torch.device, width: int = 1):
        asking = [i for i, req in enumerate(reqs) if req.params.logprobs is not None]
        self.rids = [reqs[i].rid for i in asking]
        self.wanted = [reqs[i].params.logprobs for i in asking]
        self.rows = upload(np.asarray(asking, dtype=np.int64), device)  # pinned: no wait for a run in flight
        self.top = max(self.wanted)
        a = len(asking)
        self.chosen = torch.empty(steps, a, width, device=device)
        self.top_values = torch.empty(steps, a, width, self.top, device=device)
        self.top_ids = torch.empty(steps, a, width, self.top, dtype=torch.int64, device=device)
        self._back = None

    @classmethod
    def of(cls, reqs: list, steps: int, device: torch.device, width: int = 1) -> "RunLogprobs | None":
        return cls(reqs, steps, device, width) if any(req.params.logprobs is not None for req in reqs) else None

    def record(self, logits: torch.Tensor, tokens: torch.Tensor, k: int) -> None:
        """Step ``k``: ``logits`` [n, width, V] (or [n, V]) of every row of the run, ``tokens`` [n, width]
        (or [n]) the token each node emits (past a round's count: whatever; dropped when read)."""
        n = tokens.shape[0]
        logp = logits.reshape(n, -1, logits.shape[-1])[self.rows].float().log_softmax(dim=-1)
        self.chosen[k] = logp.gather(2, tokens.reshape(n, -1)[self.rows].unsqueeze(2)).squeeze(2)
        if self.top:
            self.top_values[k], self.top_ids[k] = logp.topk(min(self.top, logp.shape[-1]), dim=-1)

    def queue_readback(self) -> None:
        """Right after the run's last step is queued (see HostReadback)."""
        self._back = [HostReadback(t) for t in (self.chosen, self.top_values, self.top_ids)]

    def read(self) -> dict[str, list[list[TokenLogprobs]]]:
        """Wait for the run → per asking request and step, one entry per node (one for a decode step)."""
        chosen, values, ids = (b.tolist() for b in self._back)
        return {rid: [[TokenLogprobs(chosen[k][j][w], tuple(zip(ids[k][j][w][:want], values[k][j][w][:want])))
                       for w in range(len(chosen[k][j]))] for k in range(len(chosen))]
                for j, (rid, want) in enumerate(zip(self.rids, self.wanted))}

    def read_steps(self) -> dict[str, list[TokenLogprobs]]:
        """``read`` for decode steps: one entry per step."""
        return {rid: [nodes[0] for nodes in steps] for rid, steps in self.read().items()}


def wants_prompt_logits(req: Request) -> bool:
    """Whether the request's prefill needs logits at every prompt position it computes (params.prompt_logprobs, not
    sent yet: a preempted request's recomputation does not need them again)."""
    return req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent


def cacheable_prompt_tokens(req: Request) -> int:
    """How many of the prompt's first tokens the prefix cache may supply: those before the first position whose logits
    give a wanted prompt entry (position t - 1 for token t), or all but the last."""
    if wants_prompt_logits(req):
        return min(req.num_tokens - 1, req.params.prompt_logprobs_from - 1)
    return req.num_tokens - 1


def prompt_logits_skip(p) -> int | None:
    """Of a prefill chunk ``p``'s tokens, how many come before the first whose logits give a wanted prompt entry
    (position prompt_logprobs_from - 1 on: its tokens from there on have logits); None: the chunk needs its last
    token's alone (no prompt entry wanted, or none in this chunk)."""
    if not wants_prompt_logits(p.req):
        return None
    skip = max(0, p.req.params.prompt_logprobs_from - 1 - p.start)
    return skip if skip < p.end - p.start - 1 else None  # (its last row alone: as any prompt's, graphable)


def prefill_rows(prefills) -> list[tuple[int, int]]:
    """(first row, rows) of each prefill chunk in a forward's logits: its tokens' from the first whose logits give a
    wanted prompt entry (prompt_logits_skip), else its last token's."""
    out, row = [], 0
    for p in prefills:
        skip = prompt_logits_skip(p)
        n = 1 if skip is None else p.end - p.start - skip
        out.append((row, n))
        row += n
    return out


def prompt_logprob_jobs(prefills, rows: list[tuple[int, int]]) -> list:
    """gather_logprobs jobs for the prompt tokens each chunk's rows predict (row of position t: token t+1,
    while it is a prompt token), from params.prompt_logprobs_from on."""
    jobs = []
    for p, (first, n) in zip(prefills, rows):
        if wants_prompt_logits(p.req):
            predicted = range(max(p.start + 1, p.req.params.prompt_logprobs_from), min(p.end + 1, len(p.req.prompt)))
            if predicted:
                skip = prompt_logits_skip(p)
                at = p.end - 1 if skip is None else p.start + skip  # (the position of the chunk's first logits row)
                jobs.append((p.req.rid, [first + t - 1 - at for t in predicted],
                             [p.req.prompt[t] for t in predicted], p.req.params.prompt_logprobs))
    return jobs


def keep_prompt_logprobs(prefills, logprobs: dict) -> None:
    """Append each chunk's prompt entries to its request's, in chunk order."""
    for p in prefills:
        if p.start == p.req.prefix_hit and wants_prompt_logits(p.req):  # (its first chunk: past the cached tokens)
            p.req.prompt_logprobs = []  # (again, after a preemption in the middle of its chunks)
        if p.req.rid in logprobs:
            p.req.prompt_logprobs += logprobs[p.req.rid]
