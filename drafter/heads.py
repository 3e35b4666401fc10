"""DraftHeads: the drafter's head generations, and which request drafts with which.

A request's draft KV is built by one head; a different head cannot continue it. So a reload does
not swap weights under running requests: the new head serves every request that starts after it,
and each running request stays on the head it started with until it is released. A generation
with no requests left (other than the newest) is freed.
"""

from __future__ import annotations

import logging
from typing import Iterable

from tandem.speculative.drafter import Eagle3Drafter

log = logging.getLogger("drafter.heads")


class DraftHeads:
    def __init__(self, drafter: Eagle3Drafter, draft_model: str):
        self.generation = 1
        self._heads: dict[int, tuple[Eagle3Drafter, str]] = {1: (drafter, draft_model)}
        self._owner: dict[str, int] = {}  # request id -> generation it started on

    # -- the newest head -------------------------------------------------------------------------
    @property
    def current(self) -> Eagle3Drafter:
        return self._heads[self.generation][0]

    @property
    def current_model(self) -> str:
        return self._heads[self.generation][1]

    def install(self, drafter: Eagle3Drafter, draft_model: str) -> int:
        """Make ``drafter`` the head of new requests (call between rounds); → requests left on older heads."""
        self.generation += 1
        self._heads[self.generation] = (drafter, draft_model)
        self._retire_idle()
        return len(self._owner)

    @property
    def generations(self) -> list[int]:
        return sorted(self._heads)

    # -- routing ---------------------------------------------------------------------------------
    def for_request(self, rid: str) -> tuple[int, Eagle3Drafter]:
        """The request's head; a request seen for the first time starts on the newest."""
        gen = self._owner.setdefault(rid, self.generation)
        return gen, self._heads[gen][0]

    def group(self, rids: Iterable[str]) -> dict[int, list[str]]:
        """Request ids by the generation that serves them (in the given order within a group)."""
        groups: dict[int, list[str]] = {}
        for rid in rids:
            groups.setdefault(self.for_request(rid)[0], []).append(rid)
        return groups

    def drafter(self, generation: int) -> Eagle3Drafter:
        return self._heads[generation][0]

    def release(self, rid: str) -> None:
        gen = self._owner.pop(rid, None)
        if gen is not None:
            self._heads[gen][0].release(rid)
            self._retire_idle()

    def release_all(self) -> None:
        """A new verifier stream: forget every request; only the newest head stays."""
        for drafter, _ in self._heads.values():
            drafter.release_all()
        self._owner.clear()
        self._retire_idle()

    def _retire_idle(self) -> None:
        busy = set(self._owner.values())
        for gen in [g for g in self._heads if g != self.generation and g not in busy]:
            drafter, model = self._heads.pop(gen)
            drafter.release_all()
            drafter.graphs = None  # drop the captured graphs with the head (their pool goes with them)
            log.info("freed draft head generation %d (%s): its last request finished", gen, model)
