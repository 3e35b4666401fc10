"""The ``logprobs`` objects of OpenAI responses, from the verifier's TokenLogprobs (one per generated token).

Completions: ``{tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}``, where each
``top_logprobs`` entry holds the N most likely tokens and the generated one (as vLLM), and ``text_offset``
is where each token's text starts in the choice's text (the texts of its tokens one after the other); with
``echo`` the prompt's tokens come first, the first of them with null for its log-probability (nothing
precedes it), as vLLM. Chat: ``{content: [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}]}``. A token's text is its own decode with special tokens kept;
-inf (a token the model gives no mass) is written as -9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

FLOOR = -9999.0


def _finite(v: float) -> float:
    return max(float(v), FLOOR)


class LogprobsShape:
    def __init__(self, token_text: Callable[[int], str], prompt_ids: Sequence[Sequence[int]] = ((),)):
        """``prompt_ids``: per choice, its prompt's token ids (echoed with their log-probabilities when asked)."""
        self.token_text = token_text
        self.prompt_ids = prompt_ids
        self.offsets = [0] * len(prompt_ids)  # per choice: where its next token's text starts

    def prompt(self, entries: Sequence, index: int = 0) -> dict:
        """The echoed prompt's part: ``entries`` are the verifier's, for every prompt token but the first."""
        prompt_ids = self.prompt_ids[index]
        first = prompt_ids[0]
        text = self.token_text(first)
        head = {"tokens": [text], "token_logprobs": [None], "top_logprobs": [None],
                "text_offset": [self.offsets[index]]}
        self.offsets[index] += len(text)
        return merge(head, self.completion(prompt_ids[1:], entries, index))

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


def vllm_prompt_logprobs(token_text: Callable[[int], str], prompt_ids: Sequence[int], entries: Sequence) -> list:
    """vLLM's ``prompt_logprobs``: null for the first token, then per prompt token ``{token_id: {logprob, rank,
    decoded_token}}`` for the token itself and the N most likely (``entries``: the verifier's, one per token after
    the first). ``rank`` is 1 for the most likely; the prompt token's, when not among the N, is the verifier's count
    over the vocabulary (null from a verifier that sent none)."""
    out: list = [None]
    for token, entry in zip(prompt_ids[1:], entries):
        ranked = {t: (_finite(v), i + 1) for i, (t, v) in enumerate(zip(entry.top_token_ids, entry.top_logprobs))}
        here = {token: ranked.get(token, (_finite(entry.logprob), entry.rank or None)), **ranked}
        out.append({str(t): {"logprob": v, "rank": rank, "decoded_token": token_text(t)} for t, (v, rank) in here.items()})
    return out


def merge(first: dict | None, then: dict | None) -> dict | None:
    """Two completions ``logprobs`` objects of consecutive tokens as one."""
    if first is None or then is None:
        return first if then is None else then
    return {key: first[key] + then[key] for key in first}
