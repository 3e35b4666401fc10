"""SGLang's log-probabilities in /generate's ``meta_info`` (``return_logprob``), from the verifier's TokenLogprobs:
``output_token_logprobs`` — ``[logprob, token_id, text]`` per generated token — and ``input_token_logprobs`` for the
prompt's tokens from ``logprob_start_len`` (SGLang's default -1: its last token), the first of them null (as SGLang
pads it, wherever they start); with ``top_logprobs_num`` N > 0 also ``output_top_logprobs`` / ``input_top_logprobs``:
per position the N most likely ``[logprob, token_id, text]`` (null for that first prompt entry). ``text`` is the
token's own decode with ``return_text_in_logprobs``, else null. Log-probabilities are the target's raw log-softmax
(before temperature and the other sampling settings); -inf is written as the OpenAI path writes it
(gateway/logprobs_shape.FLOOR), since JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.logprobs_shape import FLOOR


@dataclass(frozen=True)
class LogprobRequest:
    """What a /generate request asked for: its ``top_logprobs_num``, ``logprob_start_len`` (None: SGLang's -1, the
    prompt's last token alone) and ``return_text_in_logprobs``."""

    top: int = 0
    start: int | None = None
    with_text: bool = False

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the verifier must score the prompt (a part longer than its last token, whose entry is null)."""
        return self.start is not None


class LogprobLists:
    """One generation's lists, grown as its tokens come: a stream's events repeat them all (as SGLang's do), each
    token converted once, the prompt's part once."""

    def __init__(self, asked: LogprobRequest, token_text: Callable[[int], str], prompt_ids: Sequence[int]):
        self.asked, self._token_text, self.prompt_ids = asked, token_text, prompt_ids
        self.output: list = []
        self.output_top: list = []
        self.input: list | None = None  # once the prompt's entries came (SGLang's -1: at once)
        self.input_top: list | None = None
        if asked.start is None:
            self.set_prompt(())

    def _entry(self, logprob, token: int) -> list:
        return [None if logprob is None else max(float(logprob), FLOOR), token,
                self._token_text(token) if self.asked.with_text else None]

    def _tops(self, e) -> list:
        # (the verifier computed the most any prompt of the batch asked for: this one's N first)
        return [self._entry(v, t) for t, v in list(zip(e.top_token_ids, e.top_logprobs))[:self.asked.top]]

    def add(self, token_ids: Sequence[int], entries: Sequence) -> None:
        """Generated tokens and their TokenLogprobs, one each."""
        self.output += [self._entry(e.logprob, t) for t, e in zip(token_ids, entries)]
        if self.asked.top:
            self.output_top += [self._tops(e) for e in entries]

    def set_prompt(self, entries: Sequence) -> None:
        """The prompt's TokenLogprobs, one per token after the first (none needed for SGLang's -1)."""
        start = len(self.prompt_ids) - 1 if self.asked.start is None else self.asked.start
        at = [None] + [entries[i - 1] for i in range(start + 1, len(self.prompt_ids))]  # (the first padded null)
        ids = self.prompt_ids[start:]
        self.input = [self._entry(None if e is None else e.logprob, t) for t, e in zip(ids, at)]
        self.input_top = [None if e is None else self._tops(e) for e in at]

    def meta(self) -> dict:
        out = {"output_token_logprobs": self.output}
        if self.asked.top:
            out["output_top_logprobs"] = self.output_top
        if self.input is not None:
            out["input_token_logprobs"] = self.input
            if self.asked.top:
                out["input_top_logprobs"] = self.input_top
        return out
