"""The engine's acceptance reads the greedy trees' argmax for the whole batch at once: the same tokens as
each tree's own argmax, and requests whose logits acceptance must first adjust (penalties, min_tokens) or
that sample are left to their own path."""

from __future__ import annotations

import torch

from tandem.engine.acceptance import _plain_greedy_argmax
from tandem.sampling import SamplingParams
from tandem.speculative.tree import DraftTree


class _Req:
    def __init__(self, rid: str, params: SamplingParams, produced: int = 5):
        self.rid, self.params, self.output = rid, params, [1] * produced


def test_batch_argmax_equals_each_trees_own_and_skips_adjusted_or_sampled_requests():
    g = torch.Generator().manual_seed(0)
    sizes = {"a": 4, "pen": 3, "b": 2, "hot": 4, "early": 3, "c": 5}
    params = {"pen": SamplingParams(repetition_penalty=1.3), "hot": SamplingParams(temperature=0.8),
              "early": SamplingParams(min_tokens=10)}
    trees = {rid: DraftTree([0] * n, [-1] + [i - 1 for i in range(1, n)]) for rid, n in sizes.items()}
    prefill_rows = 3  # a prompt's rows come first in the logits
    logits = torch.randn(prefill_rows + sum(sizes.values()), 50, generator=g)
    logits[:, 7] = logits.max() + 1  # ties on the first maximum: the lower id wins, as torch's argmax
    logits[::2, 3] = logits[::2, 7]
    jobs, row = [], prefill_rows
    for rid, n in sizes.items():
        jobs.append((_Req(rid, params.get(rid, SamplingParams())), row, None))
        row += n
    got = _plain_greedy_argmax(jobs, trees, logits)
    assert set(got) == {"a", "b", "c"}
    for req, first, _ in jobs:
        if req.rid in got:
            assert got[req.rid] == logits[first : first + sizes[req.rid]].argmax(dim=-1).tolist()
    assert _plain_greedy_argmax([job for job in jobs if job[0].rid in ("pen", "hot")], trees, logits) == {}
