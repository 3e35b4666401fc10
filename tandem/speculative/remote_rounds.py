"""The drafter's half of a run of chain rounds, seen from the verifier, when the drafter is another
process: its chains come out of the round mailbox once the drafter's stream said so, and the accept's
outputs go into it (tandem.speculative.round_mailbox). The verifier queues its half with the same
code as in process (chain_rounds.queue_chain_rounds); the drafter queues the other half
(drafter/chain_runs.py) from the Round that announced the run.

The verifier trusts nothing of the chain but its draft tokens, and those only as guesses: each
round's root is the verifier's own last token (carried on the device from the accept before), and the
draft tokens are made finite and clamped into the vocabulary before the verify embeds them. So a
drafter that is broken, late or dead costs speculation, never the output: a wait the verifier's host
gives up on (``wait_drafted``) is released by writing the flag itself, and those rounds verify
whatever the mailbox holds.
"""

from __future__ import annotations

import time

import torch

from tandem.speculative.round_mailbox import ACCEPTED, DRAFTED, RoundMailbox


class RemoteDraftSide:
    """One run's drafter half on the verifier. ``first_round``: the lifetime round number of its round 0
    (what the Round announcing the run told the drafter), of ``rounds``. ``roots``: the requests' last tokens (a
    fresh run; a run after another carries its own on)."""

    def __init__(self, mailbox: RoundMailbox, first_round: int, rounds: int, vocab_size: int,
                 roots: list[int] | None = None):
        self.box, self.vocab_size, self._first_roots = mailbox, vocab_size, roots
        self.next_round = first_round
        self.rounds = rounds
        self.last_needed = first_round + rounds  # the DRAFTED value this run's last wait needs
        self.width = mailbox.layout.max_nd  # the accept's row stride in the mailbox
        self.snapshot: tuple = ()
        self.roots: torch.Tensor | None = None  # float64 [n]: each request's root token for the next draft

    @property
    def extend_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.box.ids.view(-1), self.box.features, self.box.counts

    def begin(self, rids: list[str], spec, rounds: int, after: "RemoteDraftSide | None") -> torch.Tensor:
        self.n, self.nd = len(rids), spec.num_draft_tokens
        if after is not None:
            self.roots = after.roots
        else:
            self.roots = torch.tensor(self._first_roots, dtype=torch.float64, device=self.box.device)
        self.rows = torch.empty(self.n, 3 * self.nd + 1, dtype=torch.float64, device=self.box.device)
        return self.draft()

    def draft(self) -> torch.Tensor:
        """Wait (on the device) for this round's chain, and take a sanitised copy of it."""
        self.box.flags.wait(self.box.stream(), DRAFTED, self.next_round + 1)
        rows, nd = self.rows, self.nd
        rows.copy_(self.box.rows[: self.n, : 3 * nd + 1])
        tokens = rows[:, 1:nd]
        torch.nan_to_num(tokens, nan=0.0, posinf=0.0, neginf=0.0, out=tokens).clamp_(0, self.vocab_size - 1)
        rows[:, 0].copy_(self.roots)
        return rows

    def extended(self, counts: torch.Tensor) -> None:
        """The accept wrote the round's tokens, features and counts into the mailbox: say so, and keep
        the next root (the round's last token)."""
        self.roots.copy_(self.box.ids[: self.n].gather(1, (counts - 1)[:, None])[:, 0])
        self.box.flags.write(self.box.stream(), ACCEPTED, self.next_round + 1)
        self.next_round += 1

    def extend_torch(self, kept: torch.Tensor, features: torch.Tensor, counts: torch.Tensor) -> None:
        n, c = kept.shape
        self.box.ids[:n, :c].copy_(kept)
        self.box.features.view(self.box.layout.max_bs, self.width, -1)[:n, :c].copy_(features)
        self.box.counts[:n].copy_(counts)
        self.extended(counts)

    def finish(self) -> None:
        pass

    def abandon(self, fresh: bool) -> None:
        pass  # the caller drops the connection: the drafter then releases its own waits

    def commit(self, rids: list[str], tokens: list, keep_pages: bool) -> None:
        pass  # the drafter commits its half from its own copy of each round's tokens

    def release(self) -> None:
        """Let this run's waits go on whatever the mailbox holds (the drafter is gone)."""
        flags = self.box.flags
        flags[DRAFTED] = max(flags[DRAFTED], self.last_needed)

    def wait_drafted(self, deadline_s: float) -> bool:
        """Poll (on the host) until the drafter's stream has written this run's last chain, up to
        ``deadline_s``; False after writing the flag itself (the drafter is late or gone: those rounds
        verify what the mailbox holds)."""
        flags, needed = self.box.flags, self.last_needed
        deadline = time.monotonic() + deadline_s
        while flags[DRAFTED] < needed:
            if time.monotonic() > deadline:
                self.release()
                return False
            time.sleep(0.0001)
        return True
