"""One generating REST request from its body to its answer, whatever the API's shape (the OpenAI API:
gateway/openai_api.py; SGLang's native /generate: gateway/sglang_api.py): admission (a slot per generation), parse,
the choices' generations on the verifier (choices.py), the answer streamed as server-sent events or whole, and one
server span and one count in ``tandem:requests`` however it ends (the client leaving included)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from gateway.admission import read_body
from gateway.errors import INTERNAL_ERROR, SHUTTING_DOWN, GatewayError
from gateway.choices import Choices
from gateway.generation import Delta, GenerationStream, SpanUsage
from gateway.logprobs_shape import vllm_prompt_logprobs
from gateway.openai_extras import choice_seed
from gateway.openai_params import Limits, OpenAIRequest, parse_chat, parse_completion, parse_json
from gateway.request import OFFLOAD_PARSE_BYTES
from gateway.openai_shapes import SSE_DONE, ChatShape, CompletionShape, DisconnectAwareStreamingResponse, sse_event
from tandem import tracing

if TYPE_CHECKING:
    from gateway.context import GatewayContext

T = TypeVar("T")
log = logging.getLogger("gateway.rest")
CLIENT_CLOSED = 499  # nginx's status for "the client went away first"; only ever seen in metrics


class ClientGone(Exception):
    """The client disconnected before the response started."""


def error_response(err: GatewayError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


class _Scope:
    """The span, the request count and the concurrency slot of one HTTP request; the first
    ``finish`` counts (possibly after the route function returned: streams), later ones are no-ops."""

    def __init__(self, gw: GatewayContext, request: Request, api: str):
        self.gw, self.api = gw, api
        self.slots = 0
        self.done = False
        self.client_gone = False  # the client disconnected (a cancel then is theirs, even while the server stops)
        attributes = {"http.request.method": request.method, "http.route": request.url.path,
                      "gen_ai.operation.name": "chat" if api == "chat_completions" else "text_completion",
                      "gen_ai.response.model": gw.cfg.model_name}
        self.span = tracing.start_span(f"gateway.{api}", parent=tracing.extract_context(request.headers),
                                       kind="server", attributes=attributes)

    async def take_slots(self, n: int) -> None:
        """One slot per generation on the verifier (``n`` choices are ``n``), waiting in line at capacity."""
        await self.gw.slots.acquire(n)
        self.slots = n

    def client_left(self) -> None:
        self.client_gone = True

    def finish(self, status: int, error: str | None = None, sent: int | None = None) -> None:
        """``status``: the request's outcome as an HTTP status (what the metrics count: a stream's error event's, 499
        for a client that left); ``sent``: the status line already sent, where that differs (a stream's 200), which
        the span's ``http.response.status_code`` holds as OpenTelemetry's HTTP conventions define it."""
        if self.done:
            return
        self.done = True
        if self.slots:
            self.gw.slots.give_back(self.slots)
        self.gw.metrics.count_request(self.api, status)
        self.span.set_attribute("http.response.status_code", status if sent is None else sent)
        if error is not None:
            tracing.end_refused_or_failed(self.span, error, server_fault=status >= 500)
        self.span.end()


async def generate(gw: GatewayContext, request: Request, api: str, shape_cls: type[CompletionShape],
                   parse: Callable[[dict, str, Limits], OpenAIRequest] | None = None) -> Response:
    """One generating request, parsed (``parse``: body, request id, limits → the request; default: the OpenAI
    completion or chat parser, by the shape), run as its choices' generations and answered in ``shape_cls``'s shape,
    streamed or whole."""
    arrival = time.monotonic()
    scope = _Scope(gw, request, api)
    request_id = f"{shape_cls.id_prefix}-{uuid.uuid4().hex}"
    choices: Choices | None = None
    try:
        raw = await read_body(request, gw.cfg.max_body_bytes, gw.cfg.body_timeout_s, gw.body_budget)
        body = parse_json(raw)
        info = await gw.client.model_info()
        limits = Limits(gw.cfg.model_names, info, gw.cfg.max_tokens_limit, gw.cfg.default_max_tokens, gw.prompt_bound,
                        gw.sampling_defaults)
        if parse is not None:
            parsing = functools.partial(parse, body, request_id, limits)
        elif shape_cls is ChatShape:
            parsing = functools.partial(parse_chat, body, request_id, gw.tokenizer, gw.chat_template, limits,
                                        gw.answer_formats)
        else:
            parsing = functools.partial(parse_completion, body, request_id, gw.tokenizer, limits)
        # Tokenizing a long prompt takes milliseconds: off the event loop, so other streams keep flowing.
        params = await asyncio.to_thread(parsing) if len(raw) > OFFLOAD_PARSE_BYTES else parsing()
        if ignored := body.ignored():
            log.warning("%s: fields present in the request but ignored: %s", request_id, ", ".join(ignored)[:300])
        # the body's bytes and parsed JSON go before the generation: held to its end, a 4 MB body of small JSON
        # values (a million objects, ~100 MB parsed) was held by every request in flight
        # the name the request used, as vLLM answers (an alias or the model's path; checked by the parse), else ours
        named = body.get("model") if isinstance(body, dict) else None
        model_name = named if isinstance(named, str) and named in gw.cfg.model_names else gw.cfg.model_name
        raw = body = parsing = None
        scope.span.set_attributes(params.generation.span_attributes())
        n = params.options.n
        await scope.take_slots(n * len(params.prompts))  # (after the body: a slow one would hold them for its read)
        token_text = (functools.partial(_token_text, gw.tokenizer) if params.generation.logprobs is not None
                      else None)
        prompts = [(part.echo_text, part.generation.prompt_ids) for part in params.prompts for _ in range(n)]
        shape = shape_cls(request_id, model_name, params.include_usage, prompts, token_text,
                          token_ids=params.options.return_token_ids)
        choices = _start_choices(gw, params, scope, arrival)
        shape.follow(choices, params)
        if params.stream:
            # Wait for the first deltas before answering, so that a refusal by the verifier (over
            # capacity, prompt too long) is an HTTP status the client can act on, not a 200 whose
            # stream carries an error.
            firsts = await _unless_disconnected(request, choices.first())
            body_iter = _sse(firsts, choices, shape, scope)
            owned, choices = choices, None  # the SSE generator owns them now
            # ...and if it is never run to its end (the client left before or while it streamed),
            # the response's close still frees the verifier's request and the slot.
            on_close = functools.partial(_abandon, owned, scope)
            cut_short = sse_event(GatewayError(503, SHUTTING_DOWN).body()) + SSE_DONE
            return DisconnectAwareStreamingResponse(body_iter, on_close, cut_short, scope.client_left,
                                                    media_type="text/event-stream",
                                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        results = await _unless_disconnected(request, choices.collect())
        scope.finish(200)
        answer = shape.response(results, choices.usage)
        if params.options.prompt_logprobs:
            token_text = functools.partial(_token_text, gw.tokenizer)
            answer = shape.with_prompt_logprobs(answer, [vllm_prompt_logprobs(token_text, ids, r.prompt_logprobs or [])
                                                         for (_, ids), r in zip(prompts, results)])
        return JSONResponse(answer)
    except BaseException as e:
        if choices is not None:  # frees the verifier's requests; first, as an aborted generation writes on the span
            choices.cancel()
        if isinstance(e, GatewayError):
            scope.finish(e.status, e.message)
            return error_response(e)
        if isinstance(e, (ClientGone, ClientDisconnect)):
            scope.finish(CLIENT_CLOSED, "client disconnected")
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(e, asyncio.CancelledError) and gw.shutting_down:  # the server's grace period is over: answered
            asyncio.current_task().uncancel()  # (not left to a traceback in uvicorn's log and its 500)
            scope.finish(503, SHUTTING_DOWN)
            return error_response(GatewayError(503, SHUTTING_DOWN))
        if isinstance(e, asyncio.CancelledError):
            scope.finish(CLIENT_CLOSED, "cancelled")
        else:
            scope.finish(500, repr(e))
        raise


def _start_choices(gw: GatewayContext, params: OpenAIRequest, scope: _Scope, arrival: float) -> Choices:
    """One generation per choice: ``n`` for each prompt of the batch, choice ``i`` the ``j``-th of its prompt, with a
    request id of its own (when there are several) and seed + j."""
    n, parts = params.options.n, params.prompts
    decode = functools.partial(gw.tokenizer.decode, skip_special_tokens=params.generation.skip_special_tokens)
    eos = tuple(gw.client.known_info.eos_token_ids) if gw.client.known_info is not None else ()
    usage = SpanUsage(scope.span)
    streams = []
    for p, part in enumerate(parts):
        for j in range(n):
            base = part.generation
            generation = base if n * len(parts) == 1 else dataclasses.replace(
                base, request_id=f"{base.request_id}-{p * n + j}", seed=choice_seed(base.seed, j))
            streams.append(GenerationStream(generation, gw.client, decode, gw.metrics, scope.span, arrival, eos,
                                            gw.request_log, span_usage=usage, counts_prompt=j == 0))
    return Choices(streams, per_prompt=n)


def _token_text(tokenizer, token: int) -> str:
    """A token's own text in log-probabilities, special tokens included (as vLLM shows them)."""
    return tokenizer.decode([token], skip_special_tokens=False)


def _abandon(choices: Choices, scope: _Scope) -> None:
    choices.cancel()
    scope.finish(CLIENT_CLOSED, "client disconnected")


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it (which cancels the
    verifier call) and raise ClientGone. The body has been read, so the next ASGI message can only
    be the disconnect."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(firsts: list[Delta], choices: Choices, shape: CompletionShape,
               scope: _Scope) -> AsyncIterator[str]:
    status, error = CLIENT_CLOSED, "client disconnected"
    try:
        for chunk in shape.opening(firsts):
            yield sse_event(chunk)
        for i, delta in enumerate(firsts):
            if (chunk := shape.chunk(delta, i)) is not None:
                yield sse_event(chunk)
        async for i, delta in choices.rest():
            if (chunk := shape.chunk(delta, i)) is not None:
                yield sse_event(chunk)
        if shape.include_usage:
            yield sse_event(shape.usage_chunk(choices.usage))
        yield SSE_DONE
        status, error = 200, None
    except GatewayError as e:
        # The response has started: the error can only travel as an event (vLLM does the same).
        status, error = e.status, e.message
        yield sse_event(e.body())
        yield SSE_DONE
    except asyncio.CancelledError:
        if scope.gw.shutting_down and not scope.client_gone:  # (its last event is the response's:
            status, error = 503, SHUTTING_DOWN  # DisconnectAwareStreamingResponse)
        raise
    except Exception:  # a bug of ours mid-stream: the stream still ends properly, saying nothing internal
        log.exception("stream %s failed", shape.id)
        status, error = 500, INTERNAL_ERROR
        yield sse_event(GatewayError(500, INTERNAL_ERROR).body())
        yield SSE_DONE
    finally:
        choices.cancel()
        scope.finish(status, error, sent=200)  # (the stream's status line went out before its first event)
