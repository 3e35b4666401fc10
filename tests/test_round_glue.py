"""The round-glue kernels (tandem/kernels/round_glue.py) against the torch code they replace between a
queued chain round's graph replays — TargetGraphRunner.advance, chain_rounds' acceptance and the
feeding and tail of DraftGraphRunner.replay_extend — on the CPU under the Triton interpreter.
Outputs are poisoned before each call, pages are scattered, chains accept every count from none to
all, and one request's draft is broken."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit (import below)
pytest.importorskip("triton")

from tandem.engine.cuda_graph import TargetGraphRunner  # noqa: E402
from tandem.kernels import round_glue  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
N, ND, PS = 5, 4, 4


def _family(g):
    pages = torch.randperm(64, generator=g)[: N * 8].view(N, 8).to(torch.int32)
    positions = (torch.randint(0, 12, (N, 1), generator=g) + torch.arange(ND)).flatten()
    return SimpleNamespace(width=ND, input_ids=torch.full((N * ND,), -7), positions=positions.clone(),
                           kv_lens=(positions.view(N, ND)[:, -1] + 1).to(torch.int32), slots=torch.full((N * ND,), -7),
                           block_tables=pages)


def _rows(g):
    rows = torch.zeros(N, 3 * ND + 1, dtype=torch.float64)
    rows[:, :ND] = torch.randint(0, 1000, (N, ND), generator=g).double()
    rows[2, 3 * ND] = 1.0  # request 2's draft came out NaN
    return rows


@pytest.mark.parametrize("moved", [False, True])
@pytest.mark.parametrize("rewritten", [False, True])
def test_advance_stages_the_verify_as_the_torch_path(moved, rewritten):
    g = torch.Generator().manual_seed(1)
    fam, rows = _family(g), _rows(g)
    reference = SimpleNamespace(**{k: (v.clone() if torch.is_tensor(v) else v) for k, v in vars(fam).items()})
    by = torch.randint(1, ND + 1, (N,), generator=g) if moved else None
    chains = torch.randint(0, 1000, (N, ND), generator=g) if rewritten else None
    broken = torch.tensor([False, True, False, False, False])

    got_broken = broken.clone()
    got = round_glue.advance(rows, got_broken, by, fam.input_ids, fam.positions, fam.kv_lens, fam.slots,
                             fam.block_tables, PS, ND, chains=chains)
    want_chains = chains if rewritten else rows[:, :ND].long()
    TargetGraphRunner.advance(SimpleNamespace(page_size=PS), reference, N, want_chains, by if moved else 0)
    assert torch.equal(got, want_chains)
    assert torch.equal(got_broken, broken | (rows[:, 3 * ND] != 0))
    for name in ("input_ids", "positions", "kv_lens", "slots"):
        assert torch.equal(getattr(fam, name), getattr(reference, name)), name


@pytest.mark.parametrize("width", [1, ND])
def test_advance_stages_a_queued_decode_step_as_the_torch_path(width):
    """A decode run's step between replays (TargetGraphRunner.advance on a GPU): no draft rows, every sequence one
    further, its page crossing included; the tokens a strided view (a column of the sampled logits' rows)."""
    g = torch.Generator().manual_seed(3)
    fam = _family(g)
    fam.width = width
    if width == 1:
        fam.positions, fam.input_ids, fam.slots = fam.positions.view(N, ND)[:, -1].clone(), fam.input_ids[:N], fam.slots[:N]
        fam.positions[0] = PS - 1  # request 0's next token opens a new page
    reference = SimpleNamespace(**{k: (v.clone() if torch.is_tensor(v) else v) for k, v in vars(fam).items()})
    tokens = torch.randint(0, 1000, (N, 2 * width), generator=g)[:, ::2]  # not contiguous

    round_glue.advance(None, None, 1, fam.input_ids, fam.positions, fam.kv_lens, fam.slots, fam.block_tables, PS, width,
                       chains=tokens.contiguous())
    TargetGraphRunner.advance(SimpleNamespace(page_size=PS), reference, N, tokens, 1)
    for name in ("input_ids", "positions", "kv_lens", "slots"):
        assert torch.equal(getattr(fam, name), getattr(reference, name)), name
    if width == 1:
        assert fam.slots[0] == fam.block_tables[0, 1] * PS  # the new page's first slot


@pytest.mark.parametrize("steered", [False, True])
def test_accept_emits_and_feeds_the_extend_as_the_torch_path(steered):
    g = torch.Generator().manual_seed(2)
    argmax = torch.randint(0, 1000, (N, ND), generator=g)
    chains = torch.randint(0, 1000, (N, ND), generator=g)
    for b in range(N):  # request b's drafts match the target for min(b, ND - 1) nodes, then miss
        accepted = min(b, ND - 1)
        chains[b, 1 : accepted + 1] = argmax[b, :accepted]
        if accepted + 1 < ND:
            chains[b, accepted + 1] = argmax[b, accepted] + 1
    broken = torch.tensor([False, False, False, True, False])  # request 3 takes the root's token only
    F, W, BS = 48, ND + 2, N + 1
    features = torch.randn(N * ND, F, generator=g)
    emitted = torch.full((N, ND + 2), -7, dtype=torch.int64)
    ext_ids, ext_features = torch.zeros(BS * W, dtype=torch.int64), torch.zeros(BS * W, F)
    aux, roots = torch.full((BS,), -7, dtype=torch.int64), torch.arange(N) * 10

    got_roots = roots.clone() if steered else None
    counts = round_glue.accept(chains, argmax, broken, features, emitted, ext_ids, ext_features, aux, W, got_roots)

    accepted = (chains[:, 1:] == argmax[:, :-1]).long().cumprod(dim=1).sum(dim=1)
    want_counts = torch.where(broken, 0, accepted) + 1
    assert want_counts.tolist() == [1, 2, 3, 1, 4]
    keep = torch.arange(ND)[None, :] < want_counts[:, None]
    kept = torch.where(keep, argmax, 0)
    assert torch.equal(counts, want_counts)
    assert torch.equal(emitted, torch.cat([kept, want_counts[:, None], broken.long()[:, None]], dim=1))
    assert torch.equal(aux[:N], want_counts) and torch.equal(aux[N:], torch.full((BS - N,), -7))
    assert torch.equal(ext_ids.view(BS, W)[:N, :ND], kept)
    want_features = torch.where(keep[:, :, None], features.view(N, ND, F), 0)
    assert torch.equal(ext_features.view(BS, W, F)[:N, :ND], want_features)
    if steered:
        assert torch.equal(got_roots, roots + want_counts)


def test_settle_leaves_the_next_drafts_inputs_as_the_torch_path():
    g = torch.Generator().manual_seed(3)
    W, BS, H, TW = ND + 2, N + 2, 40, 3
    counts = torch.tensor([1, 4, 2, 3, 1])
    ext_ids = torch.randint(0, 1000, (BS * W,), generator=g)
    lens = torch.randint(5, 50, (BS,), generator=g)
    out_state, out_logp = torch.randn(BS, H, generator=g), -torch.rand(BS, TW, generator=g)
    out_ids = torch.randint(0, 1000, (BS, TW), generator=g)
    aux = torch.full((BS,), -7, dtype=torch.int64)
    state, logp, ids = torch.full((BS + 1, H), -7.0), torch.full((BS + 1, TW), -7.0), torch.full((BS + 1, TW), -7)
    got_lens = lens.clone()

    round_glue.settle(counts, ext_ids, W, aux, got_lens, state, out_state, logp, out_logp, ids, out_ids)

    kept = ext_ids.view(BS, W)[:N]
    assert torch.equal(aux[:N], kept.gather(1, (counts - 1)[:, None])[:, 0])
    assert torch.equal(aux[N:], torch.full((BS - N,), -7))  # padding rows keep their count
    assert torch.equal(got_lens[:N], lens[:N] + counts) and torch.equal(got_lens[N:], lens[N:])
    assert torch.equal(state[:BS], out_state) and torch.equal(logp[:BS], out_logp) and torch.equal(ids[:BS], out_ids)
    assert (state[BS] == -7).all()  # rows past the bucket untouched
