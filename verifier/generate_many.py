"""GenerateMany: many generations over one bidirectional stream, each run as Generate runs it (verifier/server.py:
the same validation, submission, refusals, spans and messages), what they all got since the last batch sent as one
message.

Why: gRPC's cost is per message, whatever it carries — on both sides, in the C core and the event loop, ~20-30 µs
each (bench/verifier_front.py, bench/gateway_messages.py) — and with a stream per request every step of a batch of
B requests is B messages. Here a step's outputs, which reach this event loop in one hop (QueueSink), leave in one.

The caller names each generation with a ``key`` unique on its stream while it runs; ``start`` and ``cancel`` commands
come in, ``GenerateEvent``s go out (a response, or the status Generate would have ended with). The stream ends when
the caller has closed its side and every generation has finished; if the caller goes, its generations are cancelled.
The pace (``message_interval_us``, the gateway's load) is the stream's: the latest start's or pace command's value.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import grpc

from tandem import tracing
from tandem.errors import ConfigError
from tandem.grpc_decode import MALFORMED, tolerant
from tandem.rpc.verifier.v1 import verifier_pb2 as pb
from verifier.engine_api import QueueSink, Submission
from verifier.server import (MAX_COALESCED_TOKENS, MAX_MESSAGE_INTERVAL_US, REFUSALS, VerifierService,
                             end_request_span, is_final, merged_outputs, refusal_code)

log = logging.getLogger("verifier.generate_many")
_CLOSED = object()  # the caller closed its side of the stream
_WAKE = object()  # look at the loop's end again (the server drains; a cancel may have left nothing running)
_UNTRACKED = object()  # a refusal that answers no start of its own (a second start of a running key): always sent
# The most tokens one GenerateBatch carries (each generation's share still capped at MAX_COALESCED_TOKENS): a batch of
# what queued behind a slow write stays far below the gateway's 256 MiB a message at ~150 bytes a token (top-20
# log-probabilities); what is left waits for the next batch.
MAX_BATCH_TOKENS = 64 * MAX_COALESCED_TOKENS


class _Keyed:
    """A generation's outputs into its stream's one queue, tagged with its key and its submission (a QueueSink's
    target): a key the caller uses again after a cancel must not get the outputs its earlier generation had queued."""

    __slots__ = ("queue", "key", "sub")

    def __init__(self, queue: asyncio.Queue, key: int):
        self.queue, self.key, self.sub = queue, key, None

    def put_nowait(self, out) -> None:
        self.queue.put_nowait((self.key, out, self.sub))


@dataclass
class _Refused:
    code: grpc.StatusCode
    message: str


@dataclass
class _Running:
    rid: str
    request: Any  # pb.GenerateRequest
    sub: Submission
    span: Any
    produced: int = 0
    answered: bool = False  # a message has gone (the first one never waits for the pace)


class _Stream:
    def __init__(self, service: VerifierService, context: grpc.aio.ServicerContext):
        self.service, self.context = service, context
        self.queue: asyncio.Queue = asyncio.Queue()
        self.running: dict[int, _Running] = {}
        # key -> its latest start (the Submission once submitted, else a token of the start): a refusal or an output
        # goes only to the start it answers; one the caller cancelled, or started again, gets nothing more
        self.starts: dict[int, object] = {}
        self.pace = 0.0
        self.closed = False

    async def read(self, commands) -> None:
        """The caller's commands, until it closes its side."""
        try:
            async for command in commands:
                if command is MALFORMED:
                    self.queue.put_nowait((None, _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                                          "request: malformed GenerateCommand protobuf"), None))
                    return
                which = command.WhichOneof("command")
                try:
                    if which == "start":
                        self._start(command)
                    elif which == "cancel":
                        self._cancel(command.key)
                    elif which == "message_interval_us":
                        self._set_pace(command.message_interval_us)
                except Exception:  # (as an unexpected error in Generate's handler fails its one call: UNKNOWN)
                    log.exception("GenerateMany: the %s command of key %d failed", which, command.key)
                    running = self.running.get(command.key) if which == "start" else None
                    if running is not None:  # (submitted or not: a cancel of what is not there does nothing)
                        self.service.loop.cancel(running.rid, running.sub)
                    if which == "start":
                        self._refuse(command.key, running, grpc.StatusCode.UNKNOWN, "internal error",
                                     self.starts.get(command.key, _UNTRACKED))
        finally:
            self.queue.put_nowait((None, _CLOSED, None))

    def _start(self, command) -> None:
        key, request = command.key, command.start
        if self.service.draining:
            self._refuse(key, None, grpc.StatusCode.UNAVAILABLE, "the verifier is shutting down",
                         _UNTRACKED if key in self.running else self._new_start(key))
            return
        if key in self.running:  # (the running generation runs on; its own answers stay its own)
            self._refuse(key, None, grpc.StatusCode.INVALID_ARGUMENT, f"key {key} names a running generation",
                         _UNTRACKED)
            return
        start = self._new_start(key)
        try:
            params, spec = self.service.convert(request)
        except ConfigError as e:
            self._refuse(key, None, grpc.StatusCode.INVALID_ARGUMENT, str(e), start)
            return
        rid = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        span = self.service.request_span(rid, request, tracing.extract(dict(command.trace_context)))
        keyed = _Keyed(self.queue, key)
        try:
            sub = keyed.sub = self.service.submission(rid, request, params, spec,
                                                      QueueSink(asyncio.get_running_loop(), keyed), span)
        except Exception as e:  # (read's handler refuses the start; its span ends here, where it is known)
            tracing.end_rpc_unsuccessful(span, grpc.StatusCode.UNKNOWN.name, repr(e))
            end_request_span(span, 0)
            raise
        self.starts[key] = sub
        self.running[key] = _Running(rid, request, sub, span)
        self._set_pace(request.message_interval_us)  # (convert checked its bound)
        admitted = asyncio.wrap_future(self.service.loop.submit(sub))
        admitted.add_done_callback(lambda f: self._admitted(key, sub, f))

    def _new_start(self, key: int) -> object:
        start = self.starts[key] = object()
        return start

    def _set_pace(self, interval_us: int) -> None:
        if interval_us > MAX_MESSAGE_INTERVAL_US:
            self.queue.put_nowait((None, _Refused(grpc.StatusCode.INVALID_ARGUMENT, "message_interval_us must be at "
                                                  f"most {MAX_MESSAGE_INTERVAL_US}, got {interval_us}"), None))
            return
        self.pace = interval_us / 1e6

    def _admitted(self, key: int, sub: Submission, admitted: asyncio.Future) -> None:
        error = None if admitted.cancelled() else admitted.exception()
        if error is None:
            return
        running = self.running.get(key)
        if running is None or running.sub is not sub:  # cancelled meanwhile
            return
        if not isinstance(error, REFUSALS):
            log.error("submission of %s failed: %r", running.rid, error)
            self._refuse(key, running, grpc.StatusCode.UNKNOWN, "internal error", sub)
            return
        self._refuse(key, running, refusal_code(error), str(error), sub)

    def _refuse(self, key: int, running: _Running | None, code: grpc.StatusCode, message: str, start) -> None:
        """Refuse the start ``start`` of ``key`` (``running``: its generation, if it was running)."""
        if running is not None:
            del self.running[key]
            tracing.end_rpc_unsuccessful(running.span, code.name, message)
            end_request_span(running.span, running.produced)
        self.queue.put_nowait((key, _Refused(code, message), start))

    def _cancel(self, key: int) -> None:
        self.starts.pop(key, None)
        running = self.running.pop(key, None)
        if running is not None:  # (one that already finished: nothing to free)
            self.service.loop.cancel(running.rid, running.sub)
            end_request_span(running.span, running.produced)
            if not self.running:  # (a closed or draining stream may end now)
                self.queue.put_nowait((None, _WAKE, None))

    def cancel_all(self) -> None:
        for key in list(self.running):
            self._cancel(key)

    def _urgent(self, item) -> bool:
        """An item that goes without waiting for the pace: a generation's first output or its last word."""
        key, out, sub = item
        running = self.running.get(key)
        return (running is None or running.sub is not sub or not running.answered or is_final(out)
                or isinstance(out, _Refused))

    def _ended(self) -> bool:
        """The caller closed its side or the server drains, nothing runs, and nothing is left to send."""
        return (self.closed or self.service.draining) and not self.running and self.queue.empty()

    async def batches(self):
        """One GenerateBatch for everything queued each time this loop gets to it."""
        sent_at = None
        while not self._ended():
            items = [await self.queue.get()]
            tokens = _tokens(items[0])
            if self.pace and sent_at is not None and not self._urgent(items[0]):
                try:
                    async with asyncio.timeout_at(sent_at + self.pace):
                        while not self._urgent(items[-1]) and tokens < MAX_BATCH_TOKENS:
                            items.append(await self.queue.get())
                            tokens += _tokens(items[-1])
                except TimeoutError:  # (an item the deadline interrupted stays queued)
                    pass
            while not self.queue.empty() and tokens < MAX_BATCH_TOKENS:
                items.append(self.queue.get_nowait())
                tokens += _tokens(items[-1])
            events = await self._events(items)
            if events:
                yield pb.GenerateBatch(events=events)
                sent_at = asyncio.get_running_loop().time()

    async def _events(self, items: list) -> list:
        merged: dict[int, Any] = {}  # key -> its outputs so far, as one (insertion order: first come, first sent)
        events = []
        for key, out, sub in items:
            if out is _CLOSED:
                self.closed = True
            elif out is _WAKE:
                pass  # (the loop's condition reads the state)
            elif isinstance(out, _Refused):
                if key is None:  # the stream itself
                    await self.context.abort(out.code, out.message)
                if sub is not _UNTRACKED:
                    if self.starts.get(key) is not sub:
                        continue  # the caller cancelled that start (or started the key again): nothing more for it
                    self.starts.pop(key, None)
                events.append(pb.GenerateEvent(key=key, error=pb.GenerateError(code=out.code.value[0],
                                                                                message=out.message)))
            elif isinstance(out, BaseException):  # the engine loop died (logged there): as Generate, a retry's status
                for running in self.running.values():
                    tracing.set_error(running.span, "the engine failed")
                await self.context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier's engine failed; it restarts")
            elif key in self.running and self.running[key].sub is sub:  # (a cancelled generation's are dropped)
                before = merged.get(key)
                if before is not None and len(before.new_token_ids) >= MAX_COALESCED_TOKENS:
                    events.append(self._event(key, merged.pop(key)))
                    before = None
                merged[key] = out if before is None else merged_outputs(before, out)
        events.extend(self._event(key, out) for key, out in merged.items())
        return events

    def _event(self, key: int, out) -> pb.GenerateEvent:
        running = self.running[key]
        running.produced += len(out.new_token_ids)
        running.answered = True
        response = self.service.response(running.rid, running.request, out, running.produced)
        if out.finish_reason is not None:
            del self.running[key]
            if self.starts.get(key) is running.sub:
                del self.starts[key]
            end_request_span(running.span, running.produced)
        return pb.GenerateEvent(key=key, response=response)


def _tokens(item) -> int:
    """What a queued item adds to a batch, in tokens (MAX_BATCH_TOKENS)."""
    out = item[1]
    return len(getattr(out, "new_token_ids", ())) + len(getattr(out, "prompt_logprobs", None) or ())


def method_handler(service: VerifierService) -> grpc.RpcMethodHandler:
    """GenerateMany for ``service.handler(GenerateMany=...)``."""
    return grpc.stream_stream_rpc_method_handler(
        functools.partial(generate_many, service), request_deserializer=tolerant(pb.GenerateCommand),
        response_serializer=pb.GenerateBatch.SerializeToString)


async def generate_many(service: VerifierService, commands, context: grpc.aio.ServicerContext):
    await service.authenticate(context)
    if service.loop is None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is still loading its model")
    stream = _Stream(service, context)
    reader = asyncio.create_task(stream.read(commands))
    wake = functools.partial(stream.queue.put_nowait, (None, _WAKE, None))
    service.on_drain.add(wake)
    try:
        async for batch in stream.batches():
            yield batch
    finally:
        service.on_drain.discard(wake)
        reader.cancel()
        stream.cancel_all()  # the caller went, or the stream failed: free what still runs
