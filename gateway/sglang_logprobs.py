"""SGLang's log-probabilities in /generate's ``meta_info`` (``return_logprob``), from the verifier's TokenLogprobs:
``output_token_logprobs`` — ``[logprob, token_id, text]`` per generated token — and, from ``logprob_start_len``
(-1, SGLang's default: none), ``input_token_logprobs`` for the prompt's tokens from there, the first token of the
prompt with null (nothing precedes it); with ``top_logprobs_num`` N > 0 also ``output_top_logprobs`` /
``input_top_logprobs``: per position the N most likely ``[logprob, token_id, text]`` (null for the prompt's first
token). ``text`` is the token's own decode with ``return_text_in_logprobs``, else null. Log-probabilities are the
target's raw log-softmax (before temperature and the other sampling settings); -inf is written as the OpenAI path
writes it (gateway/logprobs_shape.FLOOR), since JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.logprobs_shape import FLOOR


@dataclass(frozen=True)
class LogprobRequest:
    """What a /generate request asked for: its ``top_logprobs_num``, ``logprob_start_len`` (None: no prompt part) and
    ``return_text_in_logprobs``."""

    top: int = 0
    start: int | None = None
    with_text: bool = False


def meta_logprobs(asked: LogprobRequest, token_text: Callable[[int], str], token_ids: Sequence[int],
                  entries: Sequence, prompt_ids: Sequence[int], prompt_entries: Sequence | None) -> dict:
    """The meta_info keys for one generation so far: ``entries`` one per ``token_ids``, ``prompt_entries`` one per
    prompt token after the first (None until they came)."""

    def entry(logprob, token: int) -> list:
        return [None if logprob is None else max(float(logprob), FLOOR), token,
                token_text(token) if asked.with_text else None]

    def tops(e) -> list:
        return [entry(v, t) for t, v in zip(e.top_token_ids, e.top_logprobs)]

    out = {"output_token_logprobs": [entry(e.logprob, t) for t, e in zip(token_ids, entries)]}
    if asked.top:
        out["output_top_logprobs"] = [tops(e) for e in entries]
    if asked.start is not None and prompt_entries is not None:
        positions = range(asked.start, len(prompt_ids))
        at = [None if i == 0 else prompt_entries[i - 1] for i in positions]
        out["input_token_logprobs"] = [entry(None if e is None else e.logprob, prompt_ids[i]) for i, e in zip(positions, at)]
        if asked.top:
            out["input_top_logprobs"] = [None if e is None else tops(e) for e in at]
    return out
