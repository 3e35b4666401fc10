"""The rules that read a request's own tokens (tandem.request_logits: penalties, min_tokens) inside a run of
decode steps queued on the device (tandem.engine.decode_ahead), where the host does not see the tokens
until the run is read back: the run keeps each such request's token counts on the device and updates them
with every step's token, and knows from the step's index how many tokens the request has produced. The
logits are what ``request_logits`` gives on the host for the same tokens.

A run queued after another that is not read back yet (``after``) goes on from that run's rows and counts,
which already hold its tokens in stream order; ``queued`` is the number of its steps the host has not
committed. (A run after one without rules needs none: whether a rule applies only ever turns off.)
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.request_logits import history_matters
from tandem.staging import upload


class RunRules:
    def __init__(self, reqs: list, steps: int, device: torch.device, vocab: int, eos_token_ids,
                 after: "RunRules | None", queued: int):
        picked = (after.picked if after is not None else
                  [i for i, req in enumerate(reqs) if history_matters(req.params, len(req.output) + queued)])
        params = [reqs[i].params for i in picked]
        # (host lists go up through pinned memory: a run queued behind one in flight must not wait for it)
        self.rows = upload(np.asarray(picked, dtype=np.int64), device)
        col = lambda values: upload(np.asarray(values, dtype=np.float32), device).unsqueeze(1)  # noqa: E731
        self.repetition = col([p.repetition_penalty for p in params])
        self.presence = col([p.presence_penalty for p in params])
        self.frequency = col([p.frequency_penalty for p in params])
        if after is not None:
            self.counts, self.seen = after.counts, after.seen  # updated by its steps, on the device
        else:
            self.counts = torch.zeros(len(picked), vocab, dtype=torch.int64, device=device)
            self.seen = torch.zeros(len(picked), vocab, dtype=torch.bool, device=device)
            for j, i in enumerate(picked):
                out = reqs[i].output
                if out:
                    self.counts[j].index_add_(0, torch.tensor(out, device=device),
                                              torch.ones(len(out), dtype=torch.int64, device=device))
                self.seen[j, torch.tensor(reqs[i].prompt + out, device=device)] = True
        self.picked = picked
        if after is not None:
            self.stops = after.stops  # (the same requests and parameters)
        else:  # [R, vocab] set on the device from the (row, token) pairs: a host array that wide is megabytes a run
            pairs = [(j, t) for j, p in enumerate(params)
                     for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)) if 0 <= t < vocab]
            at = upload(np.asarray(pairs, dtype=np.int64).reshape(-1, 2), device)
            self.stops = torch.zeros(len(picked), vocab, dtype=torch.bool, device=device)
            self.stops[at[:, 0], at[:, 1]] = True
        produced = [len(reqs[i].output) + queued for i in picked]
        early = np.array([[n + k < p.min_tokens for n, p in zip(produced, params)] for k in range(steps)],
                         dtype=np.bool_).reshape(steps, len(picked))
        self.early = upload(early, device).unsqueeze(2)  # [steps, R, 1]

    @classmethod
    def of(cls, reqs: list, steps: int, device, vocab: int, eos_token_ids, after=None, queued: int = 0):
        """The run's rules, or None when no request needs any. ``after``: the RunRules of the run this one
        follows (``False``: that run had none)."""
        if after is False or not any(history_matters(req.params, len(req.output) + queued) for req in reqs):
            return None
        return cls(reqs, steps, device, vocab, eos_token_ids, after, queued)

    def apply(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """Step ``k``'s logits [n, V] → float32 logits with the rules applied to the picked rows (a copy)."""
        logits = logits.float().clone()
        sub = logits[self.rows]
        sub = torch.where(self.seen, torch.where(sub > 0, sub / self.repetition, sub * self.repetition), sub)
        sub = sub - (self.frequency * self.counts.float() + self.presence * (self.counts > 0).float())
        logits[self.rows] = sub.masked_fill(self.stops & self.early[k], float("-inf"))
        return logits

    def update(self, tokens: torch.Tensor) -> None:
        """The step's tokens [n]: counted for the picked rows."""
        picked = tokens[self.rows].unsqueeze(1)
        self.counts.scatter_add_(1, picked, torch.ones_like(picked))
        self.seen.scatter_(1, picked, True)
