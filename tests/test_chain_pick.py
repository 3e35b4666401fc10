"""tandem/kernels/chain_pick.py against torch: the first maximum of each row (ties included) mapped
to target ids, the score plus its clamped log-softmax value, NaN rows flagged by a NaN score — under
Triton's interpreter on a CPU machine."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit

triton = pytest.importorskip("triton")
from tandem.kernels.chain_pick import BLOCK, chain_pick  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(logits, d2t, score):
    logp = torch.log_softmax(logits.float(), dim=-1).clamp(max=0.0)
    best_logp, best = logp.max(dim=-1)  # torch.max: the first maximal index
    return best + d2t[best], score + best_logp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [300, BLOCK + 77])  # one block; more than one, the last partial
def test_chain_pick_equals_torch(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=g) * 3).to(dtype)
    # Ties for the maximum: row 1 in two places of one block, row 2 across blocks, row 3 everywhere.
    logits[1, [5, 17]] = 40.0
    logits[2, [vocab - 1, 3]] = 40.0
    logits[3] = 1.0
    d2t = torch.randint(0, 5000, (vocab,), generator=g)
    scores = torch.randn(6, 8, generator=g)  # the chain's score so far: a strided column, as in the drafter
    logits, d2t, scores = logits.to(DEVICE), d2t.to(DEVICE), scores.to(DEVICE)
    token, score = chain_pick(logits, d2t, scores[:, 0])
    want_token, want_score = reference(logits, d2t, scores[:, 0])
    assert token.tolist() == want_token.tolist()
    assert token[1].item() == 5 + d2t[5].item() and token[2].item() == 3 + d2t[3].item()
    assert token[3].item() == 0 + d2t[0].item()
    torch.testing.assert_close(score, want_score, atol=1e-5, rtol=1e-5)
    assert scores[:, 0].tolist() == scores.cpu()[:, 0].tolist()  # the input score is left as it was


def test_a_row_with_nan_gets_a_nan_score_and_a_token_in_range():
    logits = torch.randn(3, 500)
    logits[1, 123] = float("nan")
    logits[2] = float("nan")
    d2t = torch.zeros(500, dtype=torch.int64)
    token, score = chain_pick(logits.to(DEVICE), d2t.to(DEVICE), torch.zeros(3, device=DEVICE))
    assert not torch.isnan(score[0]) and torch.isnan(score[1]) and torch.isnan(score[2])
    assert 0 <= token.min().item() and token.max().item() < 500


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="d2t"):
        chain_pick(torch.zeros(2, 10), torch.zeros(9, dtype=torch.int64), torch.zeros(2))
    with pytest.raises(ValueError, match="score"):
        chain_pick(torch.zeros(2, 10), torch.zeros(10, dtype=torch.int64), torch.zeros(3))
