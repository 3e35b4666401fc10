"""The OpenAI and vLLM sampling fields the engine implements beyond temperature, top-p and top-k: ``min_p``,
``min_tokens``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` and the log-probability
fields (completions: ``logprobs: N``, with ``echo`` the prompt's too; chat: ``logprobs: true`` with
``top_logprobs: N``). Each is checked
here with a 400 naming it; unset ones take the model's generation_config.json value where it states one
(repetition_penalty, min_p), as vLLM does."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.body_fields import integer, number
from gateway.errors import bad_request
from gateway.generation_defaults import SamplingDefaults
from tandem.sampling_limits import MAX_ABS_PENALTY, MAX_LOGPROBS, MAX_REPETITION_PENALTY


@dataclass(frozen=True)
class EngineSampling:
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # completions' echo with logprobs: the prompt tokens' as well (vLLM)


def parse_engine_sampling(body: dict, chat: bool, defaults: SamplingDefaults, echo: bool) -> EngineSampling:
    min_p = number(body, "min_p", defaults.min_p)
    if not 0.0 <= min_p <= 1.0:
        raise bad_request("min_p", f"must be in [0, 1], got {min_p}")
    repetition = number(body, "repetition_penalty", defaults.repetition_penalty)
    if not 0.0 < repetition <= MAX_REPETITION_PENALTY:
        raise bad_request("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 is off), "
                                                f"got {repetition}")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        penalties[name] = number(body, name, 0.0)
        if not -MAX_ABS_PENALTY <= penalties[name] <= MAX_ABS_PENALTY:
            raise bad_request(name, f"must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {penalties[name]}")
    min_tokens = integer(body, "min_tokens", 0)
    if min_tokens < 0:
        raise bad_request("min_tokens", f"must be >= 0, got {min_tokens}")
    logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    return EngineSampling(min_p, min_tokens, repetition, penalties["presence_penalty"],
                          penalties["frequency_penalty"], logprobs, _prompt_logprobs(body, logprobs if echo else None))


def check_min_tokens(min_tokens: int, max_tokens: int, max_param: str) -> None:
    if min_tokens > max_tokens:
        raise bad_request("min_tokens", f"must be at most {max_param} ({max_tokens}), got {min_tokens}")


def check_logprobs_count(n: int, param: str) -> int:
    """``n`` most likely tokens a position, within what the engine reports (a 400 naming ``param`` beyond)."""
    if not 0 <= n <= MAX_LOGPROBS:
        raise bad_request(param, f"must be in [0, {MAX_LOGPROBS}], got {n}")
    return n


def _completion_logprobs(body: dict) -> int | None:
    """Completions: ``logprobs: N`` — the token's log-probability and the N most likely (0: the token's only)."""
    if body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs", "is a chat completions field; completions take logprobs: N")
    v = body.get("logprobs")
    if v is None or v is False:  # false: what some clients send for "none"
        return None
    return check_logprobs_count(integer(body, "logprobs", 0), "logprobs")


def _prompt_logprobs(body: dict, echoed: int | None) -> int | None:
    """The prompt's log-probabilities: vLLM's ``prompt_logprobs: N`` (each prompt token's and the N most likely), or
    ``echoed``'s (completions' echo with logprobs); both asked for, they must agree (one set is computed)."""
    if body.get("prompt_logprobs") is None:
        return echoed
    n = check_logprobs_count(integer(body, "prompt_logprobs"), "prompt_logprobs")
    if echoed is not None and echoed != n:
        raise bad_request("prompt_logprobs", f"must equal logprobs ({echoed}) when echo asks for the prompt's too, got {n}")
    return n


def _chat_logprobs(body: dict) -> int | None:
    """Chat: ``logprobs: true`` for the token's, ``top_logprobs: N`` (which needs it) for the N most likely."""
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad_request("logprobs", f"must be true or false, got {json.dumps(on)[:40]}")
    top = body.get("top_logprobs")
    if top is not None:
        top = check_logprobs_count(integer(body, "top_logprobs", 0), "top_logprobs")
        if not on:
            raise bad_request("top_logprobs", "needs logprobs set to true")
    return (top or 0) if on else None
