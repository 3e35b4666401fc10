"""The drafter's half of runs of chain rounds queued on the device across the service pair.

A Round with a ``chain_run`` asks the drafter to queue ``rounds`` greedy chain rounds of its requests
(tandem.speculative.round_mailbox has the hand-off): per round, the draft, its rows into the mailbox,
DRAFTED; then, once the verifier's stream wrote ACCEPTED, the accepted tokens, their features and the
count out of the mailbox into the extend's inputs, the extend, and the next draft's inputs settled on
the device — the in-process half (chain_rounds.LocalDraftSide) with the mailbox in between. The run
also keeps each round's tokens and count, which is what the drafter commits it with once it is done:
nothing about the run has to come back from the verifier.

A run can go on after the previous one (``continues``): it is queued from the device's state before
the previous run is read back, which happens after the reply, while the device works.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tandem.staging import HostReadback
from tandem.speculative.chain_rounds import LocalDraftSide, drafter_rounds_fit
from tandem.speculative.round_mailbox import ACCEPTED, DRAFTED, RoundMailbox

log = logging.getLogger("drafter.chain_runs")


@dataclass
class _Run:
    side: LocalDraftSide
    rids: list[str]
    spec: object
    rounds: int
    record: HostReadback  # int64 [rounds, n, nd + 1]: the round's tokens (zero past the count) | count
    last_needed: int  # the ACCEPTED value the run's last wait needs


class ChainRuns:
    """One connection's runs. ``deadline_s``: how long a read-back waits for the verifier's flags before
    the connection is taken as gone (its waits are then released by this host)."""

    def __init__(self, mailbox: RoundMailbox, deadline_s: float = 30.0):
        self.box, self.deadline_s = mailbox, deadline_s
        self.pending: _Run | None = None  # queued, not read back and committed
        self.queued_upto = 0  # the ACCEPTED value the latest run's waits need, queued in full or not (abandon)

    def check(self, drafter, rids: list[str], spec, rounds: int, continues: bool) -> tuple[str, int]:
        """Why the run cannot be queued ("" when it can), and where only the drafter's graphs or pages refuse it, the
        most rounds of it that fit (else 0). A run that does not continue the pending one first has that one read back
        and committed."""
        previous = self.pending if continues else None
        if continues and (previous is None or previous.rids != rids or previous.spec != spec):
            return "a run that continues must follow the last run of the same requests", 0
        if not continues and self.pending is not None:
            self.settle()
        nd, box = spec.num_draft_tokens, self.box
        if len(rids) > box.layout.max_bs or nd > box.layout.max_nd:
            return f"{len(rids)} requests of {nd} tokens do not fit the mailbox", 0
        before = previous.rounds if previous else 0
        if not drafter_rounds_fit(drafter, rids, spec, rounds + before):
            fits = next((r for r in range(rounds - 1, 0, -1) if drafter_rounds_fit(drafter, rids, spec, r + before)), 0)
            return "the run does not fit the drafter's graphs or pages", fits
        return "", 0

    @torch.inference_mode()
    def queue(self, drafter, rids: list[str], spec, first_round: int, rounds: int, continues: bool) -> "_Run | None":
        """Queue a run ``check`` accepted → the run it follows (to ``settle`` with ``keep_pages``), if any.
        On the GPU this returns once the rounds are queued; on CPU, once they are done (in step with
        the verifier's, through the flags)."""
        previous = self.pending if continues else None
        nd, box = spec.num_draft_tokens, self.box
        side, n = LocalDraftSide(drafter), len(rids)
        graphs, stream = drafter.graphs, box.stream()
        self.queued_upto = first_round + rounds  # (a run that fails part-way has waits queued: abandon releases them)
        rows = side.begin(rids, spec, rounds, previous.side if previous else None)
        record = torch.empty(rounds, n, nd + 1, dtype=torch.int64, device=box.device)
        # one row a request (the buffers may be longer: sized for the prompt-extend family too)
        ids = graphs.token_ids[: n * side.width].view(n, side.width)
        features = graphs.features[: n * side.width].view(n, side.width, -1)
        mail_features = box.features.view(box.layout.max_bs, box.layout.max_nd, -1)
        for r in range(rounds):
            g = first_round + r
            if r:
                rows = side.draft()
            box.rows[:n, : 3 * nd + 1].copy_(rows)
            box.flags.write(stream, DRAFTED, g + 1)
            box.flags.wait(stream, ACCEPTED, g + 1)
            record[r, :, :nd].copy_(box.ids[:n, :nd])
            record[r, :, nd].copy_(box.counts[:n])
            ids[:n, :nd].copy_(record[r, :, :nd])
            features[:n, :nd].copy_(mail_features[:n, :nd])
            counts = record[r, :, nd].clone()
            graphs.aux[:n].copy_(counts)
            side.extended(counts)
        side.finish()
        self.pending = _Run(side, list(rids), spec, rounds, HostReadback(record), first_round + rounds)
        return previous

    @torch.inference_mode()
    def settle(self, run: "_Run | None" = None, keep_pages: bool = False) -> None:
        """Read ``run`` (default: the pending one, with nothing after it) back and commit it."""
        if run is None:
            run, self.pending = self.pending, None
            if run is None:
                return
        flags, deadline = self.box.flags, time.monotonic() + self.deadline_s
        while flags[ACCEPTED] < run.last_needed:  # the host's view: a read-back never waits on a dead verifier
            if time.monotonic() > deadline:
                log.warning("the verifier did not accept a queued run within %.0f s; releasing it", self.deadline_s)
                self.abandon()
                raise TimeoutError("the verifier stopped accepting a queued run")
            time.sleep(0.0001)
        per_round = run.record.tolist()
        nd = run.spec.num_draft_tokens
        tokens = [[per_round[r][b][: per_round[r][b][nd]] for r in range(run.rounds)] for b in range(len(run.rids))]
        run.side.commit(run.rids, tokens, keep_pages)

    def abandon(self) -> None:
        """The connection is over: release this process's waits on the verifier's flag (the rounds then
        run on whatever the mailbox holds) and forget the runs (the drafter forgets every request)."""
        needed = max([r.last_needed for r in (self.pending,) if r is not None] + [self.queued_upto])
        if needed > self.box.flags[ACCEPTED]:
            self.box.flags[ACCEPTED] = needed
        self.pending = None
