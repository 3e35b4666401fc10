"""What the EAGLE-3 head does when its own KV pool cannot hold every running request's entries (a head sized
below the verifier's cache: ``--max-kv-tokens``, or a GPU's share): the requests that came last give way.

An extend that does not fit sheds the newest of its requests (their draft state released; the oldest keep
drafting, as a scheduler preempts the newest first). A shed request answers each draft with its bare root —
it verifies without draft tokens, exactly as a plain step — and its later extends only move that root, until
it is released (it finished) or started again (``attach_prefix``: the engine's join of running requests). A
draft whose scratch entries do not fit leaves its newest requests out of this draft only (bare roots; their
state is kept). Either way the round goes on and the output is the target's: nothing fails the connection.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("tandem.drafter")
LOG_EVERY_S = 10.0  # a pool that stays short sheds every few rounds: one line for all of them


class ShedRequests:
    """The requests the head gave up on: rid → the last token it was given (the root of its bare trees)."""

    def __init__(self, clock=time.monotonic):
        self.roots: dict[str, int] = {}
        self.total = 0  # requests shed since start (a gauge of a head sized too small)
        self._clock, self._logged_at, self._unlogged = clock, float("-inf"), 0

    def __contains__(self, rid: str) -> bool:
        return rid in self.roots

    def add(self, rid: str, root: int, capacity_tokens: int) -> None:
        self.roots[rid] = root
        self.total += 1
        self._unlogged += 1
        now = self._clock()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning("the draft KV cache (%d tokens) cannot hold every running request: %d of the newest verify "
                        "without drafts until they finish (%d since start; raise --max-kv-tokens)",
                        capacity_tokens, self._unlogged, self.total)
            self._logged_at, self._unlogged = now, 0

    def move_root(self, rid: str, root: int) -> None:
        self.roots[rid] = root

    def forget(self, rid: str) -> None:
        self.roots.pop(rid, None)

    def clear(self) -> None:
        self.roots.clear()


def newest_first(rids: list[str], known: dict) -> list[int]:
    """Indices of ``rids`` from the newest request to the oldest: requests the head does not know yet (in their
    order, the later newer) before those it knows (``known``: rid → state, in the order they started)."""
    age = {rid: i for i, rid in enumerate(known)}
    return sorted(range(len(rids)), key=lambda i: -age.get(rids[i], len(age) + i))


def past_shed(drafter, items: list) -> list:
    """The extend items of requests not shed; a shed request's extend only moves the root of its bare trees."""
    for rid, tokens, _ in items:
        if rid in drafter.shed:
            drafter.shed.move_root(rid, tokens[-1])
    return [item for item in items if item[0] not in drafter.shed]


def pages_needed(drafter, items: list) -> int:
    """Pages the pool must give for these extend items (rid, tokens, features)."""
    reqs = drafter.requests
    return sum(reqs[rid].kv.pages_needed(reqs[rid].kv.num_tokens + len(tokens)) if rid in reqs
               else drafter.allocator.pages_for(len(tokens)) for rid, tokens, _ in items)


def make_room(drafter, items: list) -> list:
    """The extend items that fit the pool, its newest requests shed until they do."""
    if pages_needed(drafter, items) <= drafter.allocator.num_free:
        return items  # (every round's case: no ordering of the held requests)
    rids, shed = [rid for rid, _, _ in items], set()
    for i in newest_first(rids, drafter.requests):
        if pages_needed(drafter, [it for j, it in enumerate(items) if j not in shed]) <= drafter.allocator.num_free:
            break
        drafter.release(rids[i])
        drafter.shed.add(rids[i], items[i][1][-1], drafter.allocator.capacity_pages * drafter.cfg.page_size)
        shed.add(i)
    return [it for j, it in enumerate(items) if j not in shed]


def scratch_room(drafter, rids: list[str], scratch: int) -> list[str]:
    """The requests whose ``scratch`` draft entries fit the pool, the newest left out of this draft until they do."""
    def fits(kept: list[str]) -> bool:
        states = [drafter.requests[r] for r in kept]
        return sum(s.kv.pages_needed(s.kv.num_tokens + scratch) for s in states) <= drafter.allocator.num_free

    if fits(rids):
        return rids  # (every round's case: no ordering of the held requests)
    kept = list(rids)
    for i in newest_first(rids, drafter.requests):
        kept.remove(rids[i])
        if fits(kept):
            break
    return kept
