"""The drafter's desk for runs of chain rounds (tandem.speculative.chain_rounds), over all its verifier
connections: each connection's half of the round mailbox attached, each ChainRun checked, answered at once and
queued after the reply (drafter/chain_runs.py).

A run it took and then could not queue is a fault of this drafter, not of the connection (the 6-wide rounds on
extend buffers of 1024 rows were one): that connection ends, and every reconnect would meet the same failure,
speculation off most of the time. So for RUNS_OFF_S (or until a reload brings a new head: ``failed`` cleared) runs
are refused naming the error, and the verifier drafts one round at a time, asking again now and then (a refusal is a
round trip; connections are still offered runs, so that they come back on a connection that stays up). A verifier
gone while a run waits on it (ProposerUnavailable) is the connection's end and changes nothing here.
"""

from __future__ import annotations

import logging
import time

from tandem.errors import TandemError
from tandem.ring import RingSpec
from tandem.rpc.drafter.v1 import drafter_pb2 as pb
from tandem.speculative.proposer import ProposerUnavailable
from tandem.speculative.round_mailbox import MailboxLayout, RoundMailbox
from tandem.speculative.spec_config import SpecConfig
from drafter.chain_runs import ChainRuns

log = logging.getLogger("drafter.service")
RUNS_OFF_S = 300.0  # runs are tried again this long after one failed to queue (a transient failure: out of memory)


def nothing() -> None:
    """What is left to do after a reply that queues nothing."""


class RunDesk:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._failed: str | None = None  # why runs are refused on this drafter (one failed to queue), or None
        self._failed_at = 0.0

    @property
    def failed(self) -> str | None:
        if self._failed is not None and self.clock() - self._failed_at >= RUNS_OFF_S:
            log.info("runs of chain rounds are offered again (%s ago one failed to queue)", f"{RUNS_OFF_S:.0f} s")
            self._failed = None
        return self._failed

    @failed.setter
    def failed(self, why: str | None) -> None:
        self._failed, self._failed_at = why, self.clock()

    def attach(self, hello: pb.Hello, drafter) -> ChainRuns | None:
        """The connection's runs of chain rounds, if the verifier offered a mailbox and ``drafter`` (the head new
        requests draft with) can queue its half (graphs on the mailbox's GPU); else None (rounds go one at a time)."""
        if not hello.HasField("mailbox") or getattr(drafter, "graphs", None) is None:
            return None
        offer = hello.mailbox
        layout = MailboxLayout(offer.max_batch, offer.max_draft_tokens, hello.ring.row_width,
                               RingSpec.from_fields(hello.ring).torch_dtype)
        try:
            box = RoundMailbox.attach(layout, RingSpec.from_fields(offer.storage), offer.flags)
        except (TandemError, OSError, ValueError, RuntimeError) as e:
            log.info("round mailbox not reachable (%s); rounds go one at a time", e)
            return None
        if box.device != drafter.device:
            box.close()
            log.info("round mailbox on %s, the head on %s; rounds go one at a time", box.device, drafter.device)
            return None
        return ChainRuns(box)

    def take(self, seq: int, run: pb.ChainRun, runs: ChainRuns | None, heads):
        """Check the run now (the reply says whether it is queued, and where only pages or graphs refused it, how many
        of its rounds fit: the verifier asks that at once) → (the reply, what queues it once the reply is sent, then
        reads back and commits the run it follows). ``heads``: the drafter's DraftHeads."""
        rids, spec = list(run.request_ids), SpecConfig(run.spec.num_steps, run.spec.topk, run.spec.num_draft_tokens)
        gens, fits = {heads.for_request(rid)[0] for rid in rids}, 0
        if self.failed is not None:
            why = f"runs of chain rounds are off on this drafter since one failed to queue ({self.failed})"
        elif runs is None:
            why = "this connection has no round mailbox"
        elif len(gens) != 1:
            why = "the run's requests draft with different heads"
        else:
            drafter = heads.drafter(gens.pop())
            why, fits = runs.check(drafter, rids, spec, run.rounds, run.continues)
        reply = pb.Drafts(seq=seq, chain_run_refused=why, chain_run_fits=fits)
        if why:
            return reply, nothing

        def queue() -> None:
            try:
                previous = runs.queue(drafter, rids, spec, run.first_round, run.rounds, run.continues)
            except ProposerUnavailable:  # (the verifier gone: the connection's end, not this drafter's fault)
                raise
            except Exception as e:
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                log.error("a run of chain rounds failed to queue (%s): this drafter drafts one round at a time for "
                          "%.0f s (or until a reload of the head)", self.failed, RUNS_OFF_S)
                raise
            if previous is not None:
                runs.settle(previous, keep_pages=True)

        return reply, queue
