"""The JSON objects of the OpenAI API: completion and chat completion, whole and as stream chunks,
and the SSE framing. Shapes follow the OpenAI reference (and vLLM where OpenAI is silent)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence

import anyio
from starlette.responses import StreamingResponse

from gateway.admission import STREAM_SEND_TIMEOUT_S
from gateway.chat_answer import AnswerFormats, AnswerStream, finish_reason, message
from gateway.choices import ChoiceResult
from gateway.generation import Delta
from gateway.logprobs_shape import LogprobsShape, merge


def sse_event(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse_event("[DONE]")
CUT_SHORT_SEND_S = 1.0  # a stream cut short by the server's shutdown: at most this long to send its last event


class CompletionShape:
    """``text_completion`` objects for /v1/completions."""

    object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, request_id: str, model: str, include_usage: bool = False,
                 prompts: Sequence[tuple[str, Sequence[int]]] = (("", ()),), token_text=None,
                 token_ids: bool = False):
        """``prompts``: per choice (their number), the text echoed before its own ("" without echo; vLLM) and its
        prompt's token ids (a batch of prompts gives each its choices); ``token_text``: a token id's text, given when
        the request asked for logprobs; ``token_ids``: vLLM's ``return_token_ids`` — the prompt's token ids and each
        choice's generated ones (the EOS or stop token that ended it included) beside the text."""
        self.id, self.model, self.created = request_id, model, int(time.time())
        self.include_usage = include_usage
        self.n = len(prompts)  # choices, each streamed with its index
        self.echo_texts = [echo for echo, _ in prompts]
        self.prompt_ids = [list(ids) for _, ids in prompts] if token_ids else None
        self._prompt_ids_due = set(range(self.n)) if token_ids else set()  # streamed choices yet to name theirs
        self.logprobs = (LogprobsShape(token_text, [ids for _, ids in prompts]) if token_text is not None else None)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def follow(self, choices, request) -> None:
        """The Choices this shape answers for, once started, and the OpenAIRequest they run (a shape that reads their
        streams keeps them)."""

    def opening(self, firsts: list[Delta] = ()) -> list[dict]:
        """Chunks before any generated text: the echoed prompt, first for each choice (with its tokens'
        log-probabilities, which come on each choice's first delta)."""
        return [self._with_usage({**self._head(self.object), "choices": [self._with_token_ids(self.choice(
            echo, None, i, self._prompt_logprobs(firsts[i].prompt_logprobs if firsts else None, i)), i, [], True)]})
            for i, echo in enumerate(self.echo_texts) if echo]

    def _prompt_logprobs(self, entries: list | None, index: int) -> dict | None:
        if self.logprobs is None or entries is None:
            return None
        return self.logprobs.prompt(entries, index)

    def choice(self, text: str, finish_reason: str | None, index: int = 0, logprobs: dict | None = None,
               stop_reason: str | int | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def _with_token_ids(self, choice: dict, index: int, token_ids: list[int], streamed: bool) -> dict:
        """A completion choice with its prompt's token ids (a stream's: on the choice's first chunk) and its tokens."""
        if self.prompt_ids is None:
            return choice
        if not streamed or index in self._prompt_ids_due:
            self._prompt_ids_due.discard(index)
            choice["prompt_token_ids"] = self.prompt_ids[index]
        choice["token_ids"] = list(token_ids)
        return choice

    def _logprobs(self, token_ids: list[int], entries: list | None, index: int) -> dict | None:
        if self.logprobs is None or entries is None:
            return None
        return self.logprobs.completion(token_ids, entries, index)

    def chunk(self, delta: Delta, index: int = 0) -> dict | None:
        """The stream chunk for choice ``index``'s ``delta``, or None when it carries nothing a
        client would see (tokens whose text is still held back, and no log-probabilities)."""
        if not self._shows(delta):
            return None
        logprobs = self._logprobs(delta.token_ids, delta.logprobs, index)
        choice = self.choice(delta.text, delta.finish_reason, index, logprobs, delta.stop_reason)
        return self._with_usage({**self._head(self.object),
                                 "choices": [self._with_token_ids(choice, index, delta.token_ids, True)]})

    def _shows(self, delta: Delta) -> bool:
        """Whether a delta carries anything a client would see: text, its end, log-probabilities, or (asked for) token
        ids — tokens whose text is still held back come as ids alone."""
        return bool(delta.text or delta.finish_reason is not None or delta.logprobs
                    or (self.prompt_ids is not None and delta.token_ids))

    def with_prompt_logprobs(self, answer: dict, per_choice: list) -> dict:
        """The whole ``answer`` with vLLM's ``prompt_logprobs`` (one list per choice): on each completion choice."""
        for choice, listed in zip(answer["choices"], per_choice):
            choice["prompt_logprobs"] = listed
        return answer

    def _with_usage(self, chunk: dict) -> dict:
        # With include_usage, OpenAI puts "usage": null on every chunk but the final usage chunk.
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(self.object), "choices": [], "usage": usage}

    def response(self, results: list[ChoiceResult], usage: dict) -> dict:
        """The whole response: ``results`` holds each choice's generation, in index order."""
        choices = [self._with_token_ids(self.choice(self.echo_texts[i] + r.text, r.finish_reason, i,
                                                    merge(self._prompt_logprobs(r.prompt_logprobs, i),
                                                          self._logprobs(r.token_ids, r.logprobs, i)), r.stop_reason),
                                        i, r.token_ids, False)
                   for i, r in enumerate(results)]
        return {**self._head(self.object), "choices": choices, "usage": usage}


class ChatShape(CompletionShape):
    """``chat.completion`` / ``chat.completion.chunk`` objects for /v1/chat/completions; the answer's text read into
    reasoning, content and tool calls where the request's ``answers`` say (gateway/chat_answer.py)."""

    object = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    answers = AnswerFormats()

    def follow(self, choices, request) -> None:
        super().follow(choices, request)
        self.answers = request.answers
        self._answer_streams: dict[int, AnswerStream] = {}

    def opening(self, firsts: list[Delta] = ()) -> list[dict]:
        # Each choice's first chunk announces the role, with empty content, as OpenAI does; then the echo.
        chunks = [self._with_usage({**self._head(self.object), "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
             "stop_reason": None}]})
            for i in range(self.n)]
        if self.prompt_ids is not None:  # (vLLM: the response's, on each choice's role chunk)
            for chunk in chunks:
                chunk["prompt_token_ids"] = self.prompt_ids[0]
        chunks += [self._with_usage({**self._head(self.object), "choices": [
            {"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}]})
            for i, echo in enumerate(self.echo_texts) if echo]
        return chunks

    def _logprobs(self, token_ids: list[int], entries: list | None, index: int) -> dict | None:
        if self.logprobs is None or entries is None:
            return None
        return self.logprobs.chat(token_ids, entries)

    def chunk(self, delta: Delta, index: int = 0) -> dict | None:
        if self.answers.reads:
            stream = self._answer_streams.get(index)
            if stream is None:  # (a choice's first delta)
                stream = self._answer_streams[index] = AnswerStream(self.answers)
            fields = stream.feed(delta.text, last=delta.finish_reason is not None)
            reason = finish_reason(delta.finish_reason, stream.called)
        else:
            fields, reason = ({"content": delta.text} if delta.text else {}), delta.finish_reason
        if not (fields or reason is not None or delta.logprobs or (self.prompt_ids is not None and delta.token_ids)):
            return None
        choice = {"index": index, "delta": fields, "logprobs": self._logprobs(delta.token_ids, delta.logprobs, index),
                  "finish_reason": reason, "stop_reason": delta.stop_reason}
        if self.prompt_ids is not None:
            choice["token_ids"] = list(delta.token_ids)
        return self._with_usage({**self._head(self.object), "choices": [choice]})

    def response(self, results: list[ChoiceResult], usage: dict) -> dict:
        choices = []
        for i, r in enumerate(results):
            if self.answers.reads:
                said, called = message(self.answers, r.text, self.echo_texts[i])
            else:
                said, called = {"role": "assistant", "content": self.echo_texts[i] + r.text}, False
            choices.append({"index": i, "message": said, "logprobs": self._logprobs(r.token_ids, r.logprobs, i),
                            "finish_reason": finish_reason(r.finish_reason, called), "stop_reason": r.stop_reason})
        if self.prompt_ids is None:
            return {**self._head("chat.completion"), "choices": choices, "usage": usage}
        for choice, r in zip(choices, results):
            choice["token_ids"] = list(r.token_ids)
        return {**self._head("chat.completion"), "choices": choices, "usage": usage,
                "prompt_token_ids": self.prompt_ids[0]}

    def with_prompt_logprobs(self, answer: dict, per_choice: list) -> dict:
        answer["prompt_logprobs"] = per_choice[0]  # (vLLM's: the conversation's, on the answer itself)
        return answer


class _StalledClient(Exception):
    pass


class DisconnectAwareStreamingResponse(StreamingResponse):
    """A StreamingResponse that always watches for ``http.disconnect`` while it streams.

    Starlette only does so for ASGI servers older than spec 2.4; on newer ones a disconnect is
    noticed at the next write, which may be long in coming while the verifier is busy. Cancelling
    the body iterator at once is what lets it cancel the verifier call at once.
    """

    def __init__(self, content, on_close, cut_short: str = "", on_disconnect=lambda: None, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close  # runs once the response is over, however it ended
        self._on_disconnect = on_disconnect  # runs when the client went away, before the stream is cancelled
        # what ends a started stream that the server cancels (its shutdown's grace period over): an error event the
        # client can act on, where it would otherwise see the stream stop mid-answer
        self._cut_short = cut_short
        self.send_timeout_s = STREAM_SEND_TIMEOUT_S

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def sending(message) -> None:
            nonlocal started
            try:
                async with asyncio.timeout(self.send_timeout_s):
                    await send(message)
            except TimeoutError:
                raise _StalledClient() from None
            started = True

        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(sending)
                    except OSError:  # the client went away between our check and the write
                        pass
                    except _StalledClient:  # (its connection is closed by the server once the answer ends unfinished)
                        self._on_disconnect()
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                self._on_disconnect()
                group.cancel_scope.cancel()
        except asyncio.CancelledError:  # (a disconnect cancels inside the group: this is the server's own cancel)
            if not started:
                raise
            asyncio.current_task().uncancel()  # the answer is ended here, not left to a traceback in uvicorn's log
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CUT_SHORT_SEND_S):
                    await send({"type": "http.response.body", "body": self._cut_short.encode(), "more_body": False})
        finally:
            self._on_close()
