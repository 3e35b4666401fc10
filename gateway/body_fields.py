"""Typed reads of a JSON request body's optional fields, each a 400 naming the field when its type is wrong:
the one home for what an integer, a number and a boolean field accept."""

from __future__ import annotations

import json
import math

from gateway.errors import bad_request


def integer(body: dict, name: str, default: int | None = None) -> int | None:
    """An integer (a float with an integral value counts, as JSON clients send 2.0), or ``default``."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad_request(name, f"must be an integer, got {json.dumps(v)[:40]}")
    return v


def number(body: dict, name: str, default: float | None = None) -> float | None:
    """A finite number, or ``default``."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise bad_request(name, f"must be a number, got {json.dumps(v)[:40]}")
    return float(v)


def flag(body: dict, name: str, default: bool | None = None, param: str | None = None) -> bool | None:
    """true or false, or ``default``; ``param``: the field's name in the error (a nested one's path)."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(param or name, f"must be true or false, got {json.dumps(v)[:40]}")
    return v
