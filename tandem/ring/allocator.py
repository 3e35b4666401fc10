"""Row allocation in the hidden-state ring: contiguous ranges per round, freed when the round is answered."""

from __future__ import annotations

import bisect

from tandem.errors import TandemError


class RingFullError(TandemError, RuntimeError):
    """No contiguous run of free rows is large enough: the drafter has not replied to enough rounds."""


class RowAllocator:
    """Contiguous row ranges in a ring, tagged by round; a round's ranges are freed together.

    Allocation is next-fit: the first free run at or after the last allocation's end, else the first
    from row 0 (the wrap). Rounds may be released in any order, so free runs can sit between live
    ones; next-fit finds them. Not thread-safe on its own; ``HiddenRing`` holds the lock.
    """

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self._starts: list[int] = []  # sorted starts of live ranges
        self._ends: dict[int, int] = {}  # start -> end (exclusive)
        self._rounds: dict[int, list[int]] = {}  # seq -> starts
        self._head = 0

    @property
    def used_rows(self) -> int:
        return sum(self._ends[s] - s for s in self._starts)

    def live(self) -> list[tuple[int, int, int]]:
        """``(offset, rows, seq)`` of every live range, by offset (for diagnostics and tests)."""
        seq_of = {s: q for q, starts in self._rounds.items() for s in starts}
        return [(s, self._ends[s] - s, seq_of[s]) for s in self._starts]

    def allocate(self, rows: int, seq: int) -> int:
        if rows <= 0:
            raise ValueError(f"a ring allocation needs at least one row, got {rows}")
        if rows > self.num_rows:
            raise RingFullError(f"cannot allocate {rows} rows in a hidden-state ring of {self.num_rows} rows; "
                                f"make the ring larger")
        gaps, prev = [], 0
        for s in self._starts:
            gaps.append((prev, s))
            prev = self._ends[s]
        gaps.append((prev, self.num_rows))
        offset = next((max(a, self._head) for a, b in gaps if b - max(a, self._head) >= rows), None)
        if offset is None:  # the tail is full: wrap to row 0
            offset = next((a for a, b in gaps if b - a >= rows), None)
        if offset is None:
            held = sorted(self._rounds)
            raise RingFullError(
                f"hidden-state ring full: need {rows} contiguous rows, {self.used_rows} of {self.num_rows} "
                f"are held by {len(held)} unreleased rounds (oldest seq {held[0] if held else None}); the "
                f"drafter has not replied to them, or the ring is too small for this batch")
        bisect.insort(self._starts, offset)
        self._ends[offset] = offset + rows
        self._rounds.setdefault(seq, []).append(offset)
        self._head = (offset + rows) % self.num_rows
        return offset

    def release(self, seq: int) -> int:
        """Free every range of round ``seq``; returns the rows freed (0 for an unknown or repeated seq)."""
        freed = 0
        for s in self._rounds.pop(seq, []):
            self._starts.pop(bisect.bisect_left(self._starts, s))
            freed += self._ends.pop(s) - s
        return freed

    def release_all(self) -> int:
        return sum(self.release(seq) for seq in list(self._rounds))
