"""The ``logprobs`` objects of OpenAI responses, from the verifier's TokenLogprobs (one per generated token).

Completions: ``{tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}``, where each
``top_logprobs`` entry holds the N most likely tokens and the generated one (as vLLM), and ``text_offset``
is where each token's text starts in the choice's text. Chat: ``{content: [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}]}``. A token's text is its own decode with special tokens kept;
-inf (a token the model gives no mass) is written as -9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

FLOOR = -9999.0


def _finite(v: float) -> float:
    return max(float(v), FLOOR)


class LogprobsShape:
    def __init__(self, token_text: Callable[[int], str], n: int = 1, start_offset: int = 0):
        self.token_text = token_text
        self.offsets = [start_offset] * n  # per choice: where its next token's text starts

    def completion(self, token_ids: Sequence[int], entries: Sequence, index: int = 0) -> dict:
        texts = [self.token_text(t) for t in token_ids]
        offsets = []
        for text in texts:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(text)
        tops = []
        for token, text, entry in zip(token_ids, texts, entries):
            top = {self.token_text(t): _finite(v) for t, v in zip(entry.top_token_ids, entry.top_logprobs)}
            top.setdefault(text, _finite(entry.logprob))
            tops.append(top)
        return {"tokens": texts, "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": tops, "text_offset": offsets}

    def chat(self, token_ids: Sequence[int], entries: Sequence) -> dict:
        return {"content": [
            {**self._chat_token(token, entry.logprob),
             "top_logprobs": [self._chat_token(t, v) for t, v in zip(entry.top_token_ids, entry.top_logprobs)]}
            for token, entry in zip(token_ids, entries)]}

    def _chat_token(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
