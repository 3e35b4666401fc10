"""Token ids → text deltas whose concatenation is exactly the decode of all the ids, and best-effort
stop strings on that text.

A token may end in the middle of a UTF-8 character (byte-level BPE splits multi-byte characters),
so the decode of the output so far can end in U+FFFD that the next token turns into a real
character. We decode the whole output each time and emit only the new suffix, holding back a
trailing run of U+FFFD until later tokens settle it (or the stream ends, when it is real).
Decoding everything is O(n) per step, but it is the only scheme that is exact for every decoder
(Metaspace and WordPiece decoders change text at token boundaries); the verifier sends several
tokens per message when speculating, which divides the number of decodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._sent = ""  # text handed out so far: always a prefix of the decode of _ids

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Append ``token_ids`` and return the text that became certain. With ``final`` all
        remaining text is returned, held-back replacement characters included."""
        self._ids.extend(token_ids)
        text = self._decode(self._ids) if self._ids else ""
        if not text.startswith(self._sent):
            # The decoder rewrote text it had already produced (rare; decoders that look ahead).
            # What was sent cannot be taken back: wait until the decode agrees with it again.
            return ""
        end = len(text) if final else len(text.rstrip(REPLACEMENT))
        if end <= len(self._sent):
            return ""
        delta = text[len(self._sent):end]
        self._sent = text[:end]
        return delta

    @property
    def token_ids(self) -> list[int]:
        return self._ids


class StopStrings:
    """Cuts the text at the first occurrence of any stop string (which is not returned).

    Text that could be the start of a stop string is held back until the next text decides it, so
    a stop string split across deltas is still caught and never partly streamed.
    """

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.hit = False

    def feed(self, text: str, final: bool = False) -> str:
        """Return the text that is safe to emit; after a hit, ``hit`` is True and nothing more is."""
        if self.hit:
            return ""
        if not self._stops:
            return text
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self._pending = self._pending[:cut], ""
            return out
        keep = 0 if final else self._held_back()
        out = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop string."""
        text = self._pending
        for n in range(min(len(text), max(len(s) for s in self._stops) - 1), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self._stops):
                return n
        return 0
