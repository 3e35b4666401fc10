"""The output fields of vLLM's OpenAI server that the gateway honours without the engine's help:
``n`` (fanned out as ``n`` generations: gateway/choices.py), ``echo`` (completions only),
``skip_special_tokens`` and ``include_stop_str_in_output``. Also vLLM's fields that nothing implements
yet, refused unless they hold their no-op value (never silently ignored)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.errors import bad_request

MAX_N = 16  # each choice is a whole generation on the verifier: a bound keeps one request from a batch's worth

# Fields vLLM accepts that would need the engine (not implemented there): refused unless no-op.
ENGINE_FIELDS = {
    "prompt_logprobs": lambda v: v is None,
    "use_beam_search": lambda v: v is None or v is False,
}


@dataclass(frozen=True)
class OutputOptions:
    n: int = 1
    echo: bool = False  # completions: the prompt's text before each choice's
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


def parse_output_options(body: dict, chat: bool) -> OutputOptions:
    n = body.get("n")
    if n is None:
        n = 1
    elif isinstance(n, float) and n.is_integer():
        n = int(n)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise bad_request("n", f"must be an integer in [1, {MAX_N}], got {json.dumps(n)[:40]}")
    echo = _bool(body, "echo", False)
    if echo and chat:  # vLLM's chat echo repeats the last message: not implemented here
        raise bad_request("echo", "is not supported for chat completions")
    return OutputOptions(n, echo, _bool(body, "skip_special_tokens", True),
                         _bool(body, "include_stop_str_in_output", False))


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(name, f"must be true or false, got {json.dumps(v)[:40]}")
    return v


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: distinct per choice and reproducible when the request is seeded
    (seed + index, wrapping within the uint64 the verifier takes); unseeded choices stay unseeded."""
    return None if seed is None else (seed + index) % (1 << 64)
