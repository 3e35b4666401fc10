"""The verifier's proposer under ``--drafter in-process``: the EAGLE-3 head in this process, whose
recoverable failures become ProposerUnavailable, as a drafter service's do. A request the head cannot
serve (its draft KV cache full, a tree the head refuses) then decodes on plainly, with every other
request, instead of stopping the engine loop and with it the verifier. (A head whose deferred chain
tokens come back NaN is caught by the engine itself, after the verify: DraftLink.broken_drafts.)"""

from __future__ import annotations

import logging

from tandem.errors import TandemError
from tandem.speculative.tree import DraftTree
from tandem.speculative.proposer import Proposer, ProposerUnavailable

log = logging.getLogger("verifier.in_process_head")
RECOVERABLE = (TandemError, FloatingPointError, KeyError, ValueError)


class GuardedHead(Proposer):
    caches_prefixes = True  # attach_prefix (tandem.prefix_cache)

    def __init__(self, drafter):
        """``drafter``: the Eagle3Drafter that tandem.engine.speculative_setup attached to the engine."""
        self.drafter = drafter

    def extend(self, items) -> None:
        self.guarded(self.drafter.extend, items)

    def draft(self, rids: list[str], spec) -> list[DraftTree]:
        return self.guarded(self.drafter.draft, rids, spec)

    def attach_prefix(self, rid: str, tokens: list[int]) -> int:
        return self.guarded(self.drafter.attach_prefix, rid, tokens)

    def release(self, rid: str) -> None:
        self.drafter.release(rid)

    def release_device(self) -> None:
        self.drafter.release_device()

    @property
    def rounds_drafter(self):
        """The head, for greedy chain rounds queued on the device (tandem.engine.rounds_ahead), which the
        engine runs through ``guarded``."""
        return self.drafter

    def discard(self, reason: str) -> None:
        """The engine found a tree unusable and drops every request's draft state: so does the head."""
        self.drafter.release_all()

    def guarded(self, call, *args):
        """``call(*args)`` with the head's recoverable failures turned into ProposerUnavailable (also how
        the engine runs this head's greedy chain rounds queued on the device)."""
        try:
            return call(*args)
        except RECOVERABLE as e:
            # The engine drops every request's draft state after this (DraftLink.lost): the head's pages too.
            log.warning("the in-process head failed (%s: %s); requests running now decode without speculation",
                        type(e).__name__, e)
            self.drafter.release_all()
            raise ProposerUnavailable(f"the in-process head failed: {type(e).__name__}: {e}") from e
