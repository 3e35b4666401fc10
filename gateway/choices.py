"""The ``n`` choices of one OpenAI request: ``n`` generations on the verifier (distinct seeds: see
openai_extras.choice_seed), read together. Their first deltas are awaited before the response
starts, so a refusal of any of them is an HTTP status; then their deltas are merged as they come,
each with its choice index. Cancelling cancels every generation still running."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.generation import Delta, GenerationStream


@dataclass
class ChoiceResult:
    """One choice's whole generation."""

    text: str
    finish_reason: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None  # one TokenLogprobs per token, when asked for
    prompt_logprobs: list | None = None  # one per prompt token after the first, when asked for (echo)
    stop_reason: str | int | None = None  # (Delta.stop_reason)
    stop_token: int | None = None  # (Delta.stop_token)


class Choices:
    def __init__(self, streams: list[GenerationStream], per_prompt: int | None = None):
        """``per_prompt``: the choices of each prompt, which follow each other (default: all of them: one prompt)."""
        self.streams = streams
        self.per_prompt = per_prompt or len(streams)

    async def first(self) -> list[Delta]:
        # gather marks the exceptions of the others retrieved when one fails; cancel() ends them.
        return list(await asyncio.gather(*(anext(s) for s in self.streams)))

    async def rest(self) -> AsyncIterator[tuple[int, Delta]]:
        """(index, delta) for every delta after the first ones, in arrival order."""
        if len(self.streams) == 1:  # (most requests: read in place, not by a task and a wait per delta)
            async for delta in self.streams[0]:
                yield 0, delta
            return
        pending = {_next(s): i for i, s in enumerate(self.streams) if s.finish_reason is None}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.get):
                    i = pending.pop(task)
                    delta = task.result()  # an upstream failure ends the whole response
                    yield i, delta
                    if delta.finish_reason is None:
                        pending[_next(self.streams[i])] = i
        finally:
            for task in pending:
                task.cancel()

    async def collect(self) -> list[ChoiceResult]:
        """Each choice's whole generation, in index order."""
        return list(await asyncio.gather(*(_collect(s) for s in self.streams)))

    def cancel(self) -> None:
        for s in self.streams:
            s.cancel()  # a no-op for those that finished

    @property
    def usage(self) -> dict:
        # Each prompt is counted once (its cached part as its first choice found it) and each choice's
        # tokens are added up, as vLLM does.
        firsts = [s.usage for s in self.streams[:: self.per_prompt]]
        prompt = sum(u["prompt_tokens"] for u in firsts)
        completion = sum(s.usage["completion_tokens"] for s in self.streams)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {**firsts[0]["prompt_tokens_details"], "cached_tokens": cached}}


def _next(stream: GenerationStream) -> asyncio.Future:
    task = asyncio.ensure_future(anext(stream))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # no "never retrieved" noise
    return task


async def _collect(stream: GenerationStream) -> ChoiceResult:
    result, parts = ChoiceResult("", "stop"), []
    async for delta in stream:
        parts.append(delta.text)
        result.finish_reason = delta.finish_reason or result.finish_reason
        if delta.finish_reason:
            result.stop_reason, result.stop_token = delta.stop_reason, delta.stop_token
        result.token_ids += delta.token_ids
        if delta.logprobs is not None:
            result.logprobs = (result.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            result.prompt_logprobs = delta.prompt_logprobs
    result.text = "".join(parts)
    return result
