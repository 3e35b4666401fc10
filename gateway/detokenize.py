"""Token ids → text deltas whose concatenation is exactly the decode of all the ids, and best-effort
stop strings on that text.

Decoding the whole output at every message is quadratic in its length. As vLLM and HF do, we decode
only a window: a few already-sent tokens of context (decoders strip or join at the start of what they
are given, e.g. Metaspace's leading space) followed by the tokens not sent yet, and emit what the
window's decode adds to the decode of its context. Each message costs O(context + new tokens).

A token may end in the middle of a UTF-8 character (byte-level BPE and byte-fallback split
multi-byte characters), so a decode can end in U+FFFD that the next token turns into a real
character: that text is held back until later tokens settle it, or the stream ends (then it is
real). A valid character spans at most 4 byte tokens, so past ``MAX_HELD`` unsent tokens the run is
garbage bytes: we then commit at the latest token whose decode the window's decode extends by more
text (only the last character of a decode can still change when bytes are appended), which keeps
the window bounded for a model emitting invalid bytes too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
CONTEXT = 4  # sent tokens decoded ahead of the unsent ones
MAX_HELD = 8  # unsent tokens held for a split character before committing what is settled


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._start = 0  # window start: the first context token
        self._read = 0  # tokens before this are sent (their text is the window's prefix)

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Append ``token_ids`` and return the text that became certain. With ``final`` all
        remaining text is returned, held-back replacement characters included."""
        self._ids.extend(token_ids)
        ids, start, read = self._ids, self._start, self._read
        if read == len(ids):
            return ""
        prefix = self._decode(ids[start:read]) if read > start else ""
        text = self._decode(ids[start:])
        settled = text.startswith(prefix) and not text.endswith(REPLACEMENT)
        if final or settled:
            return self._commit(len(ids), text[_common(prefix, text):])
        if len(ids) - read <= MAX_HELD:
            return ""  # a character split across tokens, or a decoder rewriting its context: wait
        # Garbage bytes: commit at the latest token whose text is settled inside ``text``.
        for end in range(len(ids) - 1, read, -1):
            part = self._decode(ids[start:end])
            if part.startswith(prefix) and text.startswith(part) and len(part) < len(text):
                return self._commit(end, part[len(prefix):])
        return ""

    def _commit(self, end: int, delta: str) -> str:
        self._read = end
        self._start = max(0, end - CONTEXT)
        return delta

    @property
    def token_ids(self) -> list[int]:
        return self._ids


def _common(a: str, b: str) -> int:
    """Length of the common prefix (all of ``a`` unless a decoder rewrote its context)."""
    if b.startswith(a):
        return len(a)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class StopStrings:
    """Cuts the text at the first occurrence of any stop string (which is not returned, unless
    ``include``).

    Text that could be the start of a stop string is held back until the next text decides it, so
    a stop string split across deltas is still caught and never partly streamed.
    """

    def __init__(self, stops: Sequence[str], include: bool = False):
        self._stops = tuple(s for s in stops if s)
        self._include = include  # vLLM's include_stop_str_in_output: the text ends with the stop string
        self._firsts = frozenset(s[0] for s in self._stops)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._pending = ""
        self.hit = False
        self.matched: str | None = None  # the stop string that was hit

    @property
    def active(self) -> bool:
        """Whether there is any stop string to look for."""
        return bool(self._stops)

    def feed(self, text: str, final: bool = False) -> str:
        """Return the text that is safe to emit; after a hit, ``hit`` is True and nothing more is."""
        if self.hit:
            return ""
        if not self._stops:
            return text
        self._pending += text
        found = [(i, -len(s)) for s in self._stops if (i := self._pending.find(s)) >= 0]
        if found:
            self.hit = True
            cut, neg_len = min(found)  # the earliest; at one place the longest
            self.matched = self._pending[cut:cut - neg_len]
            out, self._pending = self._pending[:cut - neg_len if self._include else cut], ""
            return out
        keep = 0 if final else self._held_back()
        out = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop string."""
        text = self._pending
        for i in range(max(0, len(text) - self._longest + 1), len(text)):
            if text[i] in self._firsts:  # cheap filter: only suffixes starting like some stop string
                suffix = text[i:]
                if any(s.startswith(suffix) for s in self._stops):
                    return len(text) - i
        return 0
