"""A request body that remembers which of its top-level fields the parse read: the rest were ignored, and the
gateway logs them, as vLLM warns of fields it ignores, so that a misspelt field (``temprature``) is seen rather
than silently answered with the default."""

from __future__ import annotations

# OpenAI fields a request may carry that mean nothing to a server of one model: not worth a warning
ACCEPTED_AS_IS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})


class ReadBody(dict):
    def __init__(self, fields: dict, read: set[str] | None = None):
        super().__init__(fields)
        self.read = set() if read is None else read

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def ignored(self) -> list[str]:
        return sorted(k for k in self.keys() if k not in self.read and k not in ACCEPTED_AS_IS)


def with_field(body: dict, key: str, value) -> dict:
    """``body`` with one field replaced (a batch's prompt), its reads counted with the original's."""
    if isinstance(body, ReadBody):
        return ReadBody({**body, key: value}, body.read)
    return {**body, key: value}
