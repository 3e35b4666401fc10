"""Several greedy chain rounds per engine step, queued back to back on the device.

A round of speculative decoding in process is draft → verify → accept → draft-extend. Done one round
per engine step, the host sits between the verify and the extend (reading the verify's argmax,
walking the chain, staging the extend) and again before the next draft, while the GPU waits
(docs/benchmarks.md has what queuing gains).
For greedy chains every one of those host decisions has a fixed shape and can be made on the device
instead:

- the chain's accepted length is the run of draft tokens equal to the target's argmax at the node
  before (a cumulative product), the emitted tokens are the argmax at nodes 0..accepted — the
  accepted drafts, then the bonus;
- the accepted path is a prefix of the chain, so its KV is already where it belongs (no compaction),
  and the next verify's positions, KV lengths and slots move by the emitted count
  (``TargetGraphRunner.advance``);
- the drafter's extend takes the emitted tokens with the features of nodes 0..accepted, zero past
  the count (``DraftGraphRunner.replay_extend``), and leaves the next draft's inputs in place.

So the host queues R rounds without waiting and reads every round's tokens back once. Pages for
the worst case (every draft accepted) are reserved up front, for the target and the drafter. The
output is what R one-round steps emit (greedy acceptance against the same verify); a request that
stops mid-run (a stop token, its length) has its later rounds computed and dropped, as decode_ahead
drops steps. The engine uses it only where this holds (tandem.engine.rounds_ahead): greedy chains of
one setting, graphs for the batch on both sides, nothing else needing the host between rounds.

A run can also be queued *after* another that has not been read back (``after``): it goes on from
the device's state — lengths, positions, roots, the last round's counts — with only the block tables
staged again for the pages reserved further, so that the GPU never waits at a run's boundary while
the host reads the previous run back and commits it. Each run keeps a copy of the drafter state it
leaves (``QueuedRun.snapshot``), which is what the host commits for it, whatever runs after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tandem.forward_batch import ForwardBatch, SequenceChunk
from tandem.staging import HostReadback
from tandem.layers.fast_path import use_triton
from tandem.sampling import argmax_rows


@dataclass
class ChainRounds:
    """What a run of queued rounds made, per request (the engine's order)."""

    tokens: list[list[list[int]]]  # [request][round] → emitted tokens (accepted drafts, then the bonus)
    # [request][round] → False from the round whose draft log-probs came out NaN on: such a round took
    # only the root's token, a plain step's (its garbage was verified, none of it accepted)
    speculative: list[list[bool]]

    @property
    def broken(self) -> list[bool]:
        """Per request: its draft broke (NaN) during the run."""
        return [not all(rounds) for rounds in self.speculative]


class LocalDraftSide:
    """The drafter's half of a run when its head runs in this process: its graph runner's replays and
    static buffers, fed on the same stream as the target's (the other half is the verifier's:
    tandem.speculative.remote_rounds when the drafter is another process). One per run."""

    def __init__(self, drafter):
        self.drafter, self.graphs = drafter, drafter.graphs
        self.width = self.graphs.width  # the extend's tokens per request: the accept's row stride
        self.states: list = []
        self.draft_bs = 0
        self.snapshot: tuple = ()  # the drafter's next-draft inputs the run leaves (snapshot_rounds)

    @property
    def extend_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where the accept writes the extend's tokens, features and counts."""
        return self.graphs.token_ids, self.graphs.features, self.graphs.aux

    def begin(self, rids: list[str], spec, rounds: int, after: "LocalDraftSide | None") -> torch.Tensor:
        """Reserve the drafter's pages for ``rounds`` more rounds and stage them (from the committed state,
        or going on after the run ``after`` on the device) → the first draft's rows."""
        graphs = self.graphs
        self.states = after.states if after is not None else self.drafter.request_states(rids)
        reach = ((after.rounds if after is not None else 0) + rounds - 1) * spec.num_draft_tokens
        reach += draft_reach(self.drafter, spec)
        for s in self.states:
            s.kv.reserve(s.kv.num_tokens + reach)
        if after is None:
            self.draft_bs = graphs.begin_rounds(self.states)
        else:  # the device holds where the last run left every input; only the pages grew
            self.draft_bs = after.draft_bs
            graphs.restage_pages(self.states)
        self.rounds, self._spec = rounds, spec
        return self.draft()

    def draft(self) -> torch.Tensor:
        """Replay the draft without waiting → the trees' rows of the run's requests."""
        return self.graphs.replay_draft(self._spec, self.draft_bs)[: len(self.states)]

    def extended(self, counts: torch.Tensor) -> None:
        """After the accept fed the extend's inputs: the extend, and the next draft's inputs settled."""
        self.graphs.replay_extend_fed(self.draft_bs, counts)

    def extend_torch(self, kept: torch.Tensor, features: torch.Tensor, counts: torch.Tensor) -> None:
        """The torch glue's extend (the reference path)."""
        self.graphs.replay_extend(self.draft_bs, kept, features, counts)

    def finish(self) -> None:
        self.snapshot = self.graphs.snapshot_rounds(len(self.states))

    def abandon(self, fresh: bool) -> None:
        """Queuing failed: a fresh run gives its reserved pages back (the drafter's state is as before);
        after another run they stay, since that run still writes into them and its read-back, with
        nothing queued after it, gives back those past its tokens."""
        if fresh:
            for s in self.states:
                s.kv.truncate(s.kv.num_tokens)

    def commit(self, rids: list[str], tokens: list[list[list[int]]], keep_pages: bool) -> None:
        """The drafter's side of the run read back: every request it still holds commits the run's
        tokens (``tokens[request][round]``; ``keep_pages``: a run queued after this one still writes
        past them)."""
        keep = [b for b, rid in enumerate(rids) if self.drafter.has(rid)]  # not forgotten since
        self.graphs.end_rounds([self.states[b] for b in keep], [[t for toks in tokens[b] for t in toks] for b in keep],
                               self.snapshot, keep, keep_pages)


@dataclass
class QueuedRun:
    """A run of rounds queued on the device and not read back yet, with what a run after it goes on from."""

    reqs: list  # the engine's requests
    side: object  # the drafter's half of the run (LocalDraftSide, or the remote one)
    spec: object
    rounds: int
    fam: object  # the target's verify family, its static inputs at the run's last verify
    verify_bs: int
    emitted: HostReadback  # int64 [rounds, n, nd + 2]: tokens (0 past the count) | count | broken
    broken: torch.Tensor  # bool [n]: the draft came out NaN in some round so far
    counts: torch.Tensor  # int64 [n]: tokens the last round emitted
    roots: torch.Tensor | None  # each root's index in its sequence (only when the instrument steers)
    queued_ns: tuple[int, int]  # wall-clock span in which the host queued the rounds
    logprobs: object = None  # RunLogprobs of the requests that ask (tandem.engine.request_sampling), or None

    @property
    def snapshot(self) -> tuple:
        return self.side.snapshot


def draft_reach(drafter, spec) -> int:
    """Draft KV a round may touch past the committed entries: the draft's scratch or the padded extend."""
    return max((spec.num_steps - 1) * spec.topk, drafter.graphs.width)


def chain_rounds_fit(drafter, target_graphs, rids: list[str], spec, rounds: int) -> bool:
    """Whether ``rounds`` queued rounds (past the committed state: those of runs not read back included)
    of these requests fit both sides' graphs and the drafter's pages (the engine checks its own side:
    sampling, pages of the target, the context)."""
    return target_rounds_fit(target_graphs, len(rids), spec) and drafter_rounds_fit(drafter, rids, spec, rounds)


def target_rounds_fit(target_graphs, n: int, spec) -> bool:
    """The target's half: a verify graph of the chain's width for ``n`` requests."""
    return (target_graphs is not None and spec.topk == 1 and spec.num_draft_tokens in target_graphs.families
            and n <= target_graphs.max_bs)


def drafter_rounds_fit(drafter, rids: list[str], spec, rounds: int) -> bool:
    """The drafter's half of ``chain_rounds_fit`` (what a drafter process checks for itself)."""
    graphs = getattr(drafter, "graphs", None)
    if (spec.topk != 1 or graphs is None or spec not in graphs.trees or graphs.bucket(len(rids)) is None
            or not all(drafter.has(rid) for rid in rids)):
        return False
    states = drafter.request_states(rids)
    reach = (rounds - 1) * spec.num_draft_tokens + draft_reach(drafter, spec)
    limit = min(graphs.max_pages * graphs.page_size, drafter.head.max_positions)
    if any(s.kv.num_tokens == 0 or s.kv.num_tokens + reach > limit for s in states):
        return False
    return sum(s.kv.pages_needed(s.kv.num_tokens + reach) for s in states) <= drafter.allocator.num_free


@torch.inference_mode()
def queue_chain_rounds(target_graphs, side, reqs: list, spec, rounds: int, steer=None,
                       after: QueuedRun | None = None, logprobs=None, followers=None) -> QueuedRun:
    """Queue ``rounds`` greedy chain rounds of the engine's ``reqs`` without waiting: from their
    committed state, or going on after the run ``after`` (the same requests, not read back yet).
    ``side``: the drafter's half of this run, not begun (LocalDraftSide for an in-process drafter,
    for which ``chain_rounds_fit`` said yes). The target's pages must cover every round queued past
    the committed tokens (``rounds * num_draft_tokens`` more per run). ``steer(rids, chains [n, nd],
    root indices [n]) → chains``: the controlled-acceptance instrument's rewrite of each draft
    (benchmarks), on the device. ``logprobs``: a RunLogprobs of ``rounds`` steps, ``num_draft_tokens``
    wide, that records each round's verify (the token a node emits is the target's argmax there).
    ``followers``: the other ranks of a tensor-parallel target (TargetExecutor.round_followers), told of
    the run first; each round's verify inputs reach them by device broadcasts before its replay."""
    n, nd = len(reqs), spec.num_draft_tokens
    rids = [req.rid for req in reqs]
    told = None  # once the followers were told of the run: [rounds whose inputs reached them, rounds replayed]

    def verify(fam, bs: int, n: int):
        """A round's verify replay, its inputs first sent to the other ranks."""
        if told is not None:
            target_graphs.share_inputs(fam, n)
            told[0] += 1
        out = target_graphs.replay_prepared(fam, bs, n)
        if told is not None:
            told[1] += 1
        return out

    try:
        queue_started = time.time_ns()
        # the first draft runs while the host stages the verify
        rows = side.begin(rids, spec, rounds, after.side if after is not None else None)
        if after is None:
            chain = [[j <= i for j in range(nd)] for i in range(nd)]
            first = ForwardBatch([SequenceChunk([req.last_token] * nd, req.num_tokens - 1, req.kv.page_table(),
                                                positions=list(range(req.num_tokens - 1, req.num_tokens - 1 + nd)),
                                                tree_mask=chain, logits="all") for req in reqs])
            fam, verify_bs, _ = target_graphs.prepare(first)
            if followers is not None:
                followers.start(first, None, n, rounds)
                told = [0, 0]
            device = fam.input_ids.device
            # each root's index in its sequence, for the instrument's steering only
            roots = fam.positions[: n * nd].view(n, nd)[:, 0].clone() if steer is not None else None
            broken, counts = torch.zeros(n, dtype=torch.bool, device=device), None
        else:  # the device holds where the last run left every input; only the pages grew
            fam, verify_bs = after.fam, after.verify_bs
            tables = [req.kv.page_table(copy=False) for req in reqs]
            if followers is not None:
                followers.start(None, tables, n, rounds)
                told = [0, 0]
            target_graphs.restage_pages(fam, tables)
            roots, broken, counts = after.roots, after.broken, after.counts
            device = fam.input_ids.device
        emitted = torch.empty(rounds, n, nd + 2, dtype=torch.int64, device=device)
        round_once = _fused_round if use_triton(emitted) else _torch_round
        for r in range(rounds):
            if r:
                rows = side.draft()
            record = None if logprobs is None else (lambda logits, argmax, r=r: logprobs.record(logits, argmax, r))
            counts = round_once(target_graphs, side, fam, verify_bs, rids, rows, broken, counts, emitted[r], steer,
                                roots, record, verify)
        readback = HostReadback(emitted)
        if logprobs is not None:
            logprobs.queue_readback()
        side.finish()
        queued = (queue_started, time.time_ns())
    except BaseException:
        if told is not None:  # the other ranks replay every round they were told of, and its all-reduces need
            if told[0] > told[1]:  # this rank too: one whose inputs they have, then the rest on what stands
                target_graphs.replay_prepared(fam, verify_bs, n)
            for _ in range(rounds - told[0]):
                target_graphs.share_inputs(fam, n)
                target_graphs.replay_prepared(fam, verify_bs, n)
        side.abandon(after is None)
        raise
    return QueuedRun(reqs, side, spec, rounds, fam, verify_bs, readback, broken, counts, roots, queued, logprobs)


def _torch_round(target_graphs, side, fam, verify_bs: int, rids: list, rows, broken, counts, emitted, steer,
                 roots, record, verify) -> torch.Tensor:
    """One round's work after its draft — advance, verify, accept, extend — with the glue between the
    graphs in torch ops (the reference for the fused kernels; the path of the CPU tests) → the counts.
    ``verify(fam, bucket, n)``: the verify's replay (its inputs sent to other ranks first, if any)."""
    n, nd = emitted.shape[0], emitted.shape[1] - 2
    broken |= rows[:, 3 * nd] != 0
    chains = rows[:, :nd].long()
    if steer is not None:
        chains = steer(rids, chains, roots)
    target_graphs.advance(fam, n, chains, 0 if counts is None else counts)
    logits, features = verify(fam, verify_bs, n)
    argmax = argmax_rows(logits.view(n, nd, -1))  # [n, nd]: the target's token after each node
    if record is not None:
        record(logits.view(n, nd, -1), argmax)
    # Accepted drafts: the run of nodes 1.. whose token is the target's argmax at the node before.
    accepted = (chains[:, 1:] == argmax[:, :-1]).long().cumprod(dim=1).sum(dim=1)
    counts = torch.where(broken, 0, accepted) + 1  # a broken draft: the root's token only
    if steer is not None:
        roots += counts
    keep = torch.arange(nd, device=counts.device)[None, :] < counts[:, None]  # [n, nd]: nodes 0..accepted
    kept = torch.where(keep, argmax, 0)  # the accepted drafts, the bonus, then padding
    emitted[:, :nd] = kept
    emitted[:, nd] = counts
    emitted[:, nd + 1] = broken
    side.extend_torch(kept, torch.where(keep[:, :, None], features.view(n, nd, -1), 0), counts)
    return counts


def _fused_round(target_graphs, side, fam, verify_bs: int, rids: list, rows, broken, counts, emitted, steer,
                 roots, record, verify) -> torch.Tensor:
    """``_torch_round`` with the glue in three kernels (tandem/kernels/round_glue.py) → the counts."""
    from tandem.kernels import round_glue

    n, nd = emitted.shape[0], emitted.shape[1] - 2
    chains = steer(rids, rows[:, :nd].long(), roots) if steer is not None else None
    chains = round_glue.advance(rows, broken, counts, fam.input_ids, fam.positions, fam.kv_lens, fam.slots,
                                fam.block_tables, target_graphs.page_size, nd, chains=chains)
    logits, features = verify(fam, verify_bs, n)
    argmax = argmax_rows(logits.view(n, nd, -1))
    if record is not None:
        record(logits.view(n, nd, -1), argmax)
    ext_ids, ext_features, ext_counts = side.extend_inputs
    counts = round_glue.accept(chains, argmax, broken, features, emitted, ext_ids, ext_features, ext_counts,
                               side.width, roots)
    side.extended(counts)
    return counts


def read_chain_rounds(target_graphs, run: QueuedRun) -> ChainRounds:
    """Wait for ``run`` and read its tokens back (one copy)."""
    nd = run.spec.num_draft_tokens
    with target_graphs.guard(f"chain rounds: {run.rounds} rounds, batch {len(run.reqs)}"):
        per_round = run.emitted.tolist()
    n = len(run.reqs)
    tokens = [[per_round[r][i][: per_round[r][i][nd]] for r in range(run.rounds)] for i in range(n)]
    speculative = [[not per_round[r][i][nd + 1] for r in range(run.rounds)] for i in range(n)]
    return ChainRounds(tokens, speculative)


def end_chain_rounds(run: QueuedRun, result: ChainRounds, keep_pages: bool) -> None:
    """The drafter's side of a run read back (``keep_pages``: a run queued after this one still writes
    past its tokens)."""
    run.side.commit([req.rid for req in run.reqs], result.tokens, keep_pages)
