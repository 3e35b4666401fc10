"""The gateway's generations over one GenerateMany stream to its verifier (verifier/generate_many.py): a step's
tokens for every running generation arrive as one message instead of one message each.

``ManyStream.start`` gives a call that reads as the per-request Generate call does (``read()``: a GenerateResponse,
then ``grpc.aio.EOF`` after the one with a finish_reason; a failure raised as ``grpc.aio.AioRpcError`` with the
status Generate would have ended with; ``cancel()``), so the generation flow (gateway/generation.py) is the same over
either. The stream opens on the first start and again after it fails; a failure of the stream fails every call
running on it with its status (the verifier went away: UNAVAILABLE, which the gateway answers with a 503).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import grpc

from tandem.rpc.verifier.v1 import verifier_pb2

log = logging.getLogger("gateway.upstream_many")
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
_CANCELLED = object()  # the call was cancelled: a read waiting in another task ends as a gRPC call's would


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _unanswered(error: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """A generation's failure where its stream failed before the verifier answered it. gRPC's own INTERNAL there is
    the client's write of the start losing the race with a draining verifier's end of the stream ("Internal error
    from Core"): nothing of the generation ran, so it fails as a verifier going away does, to be retried."""
    if error.code() == grpc.StatusCode.INTERNAL:
        return _error(grpc.StatusCode.UNAVAILABLE, f"the verifier's stream ended before it answered ({error.details()})")
    return _error(error.code(), error.details())


class ManyCall:
    """One generation on the shared stream."""

    def __init__(self, stream: "ManyStream", key: int):
        self._stream, self.key = stream, key
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._over = False  # its last message read, its failure raised, or cancelled
        self.answered = False  # the verifier sent something for it

    async def read(self):
        if self._over:
            return grpc.aio.EOF
        item = await self._inbox.get()
        if item is _CANCELLED:
            raise asyncio.CancelledError()
        if isinstance(item, BaseException):
            self._over = True
            raise item
        if item.finish_reason:
            self._over = True
        return item

    def cancel(self) -> bool:
        if self._over:
            return False
        self._over = True
        self._stream._cancel(self.key)
        self._inbox.put_nowait(_CANCELLED)  # (a choice's reader in another task: gateway/choices.py)
        return True

    def _put(self, item) -> None:
        self._inbox.put_nowait(item)


class ManyStream:
    def __init__(self, open_stream, pace: Callable[[], int] = lambda: 0):
        """``open_stream(commands)``: the stub's GenerateMany with this gateway's metadata, taking an async iterator;
        ``pace()``: the message interval this gateway's load asks for now (gateway/pacing.py), kept current on the
        stream as it changes (a stream each had its pace fixed when its generation started)."""
        self._open_stream = open_stream
        self._pace, self._paced_us = pace, 0
        self._keys = itertools.count(1)
        self._calls: dict[int, ManyCall] = {}
        self._outbox: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None

    def start(self, request: verifier_pb2.GenerateRequest, trace: list[tuple[str, str]]) -> ManyCall:
        if self._reader is None or self._reader.done():
            self._open()
        call = ManyCall(self, next(self._keys))
        self._calls[call.key] = call
        self._paced_us = request.message_interval_us  # (the stream's pace from this start on)
        self._outbox.put_nowait(verifier_pb2.GenerateCommand(key=call.key, start=request, trace_context=dict(trace)))
        return call

    def _repace(self) -> None:
        """Tell the verifier the pace asked for now where it moved by more than a quarter (or to or from none)."""
        us = self._pace()
        moved = abs(us - self._paced_us) > self._paced_us / 4 or (us == 0) != (self._paced_us == 0)
        if us != self._paced_us and moved:
            self._paced_us = us
            self._outbox.put_nowait(verifier_pb2.GenerateCommand(message_interval_us=us))

    def _cancel(self, key: int) -> None:
        if self._calls.pop(key, None) is not None and self._outbox is not None:
            self._outbox.put_nowait(verifier_pb2.GenerateCommand(key=key, cancel=True))

    def _open(self) -> None:
        outbox: asyncio.Queue = asyncio.Queue()

        async def commands():
            while (command := await outbox.get()) is not None:
                yield command

        self._outbox = outbox
        log.info("the generations go over one stream to the verifier (GenerateMany)")
        self._reader = asyncio.create_task(self._read(self._open_stream(commands()), outbox), name="verifier-stream")

    async def _read(self, call, outbox: asyncio.Queue) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            async for batch in call:
                for event in batch.events:
                    target = self._calls.get(event.key)
                    if target is None:  # cancelled meanwhile
                        continue
                    if event.HasField("error"):
                        del self._calls[event.key]
                        target._put(_error(_STATUS.get(event.error.code, grpc.StatusCode.UNKNOWN), event.error.message))
                    else:
                        if event.response.finish_reason:
                            del self._calls[event.key]
                        target.answered = True
                        target._put(event.response)
                self._repace()
            error = _error(grpc.StatusCode.UNAVAILABLE, "the verifier ended the generations' stream")
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = _error(grpc.StatusCode.CANCELLED, "the gateway closed the generations' stream")
            raise
        except Exception as e:  # (a message that would not parse, a bug): its calls fail rather than wait for ever
            log.exception("the generations' stream to the verifier failed")
            error = _error(grpc.StatusCode.UNKNOWN, f"the generations' stream failed: {type(e).__name__}")
        finally:
            if self._outbox is outbox:  # the next start opens a new stream
                self._outbox, self._reader = None, None
            outbox.put_nowait(None)
            if error is None:  # (an exit no handler above saw: KeyboardInterrupt, SystemExit)
                error = _error(grpc.StatusCode.CANCELLED, "the generations' stream ended")
            if self._calls:  # (all of them this stream's: a new one opens only once this reader is done)
                log.warning("the generations' stream to the verifier ended (%s): %d generation(s) fail",
                            error.code().name, len(self._calls))
            calls, self._calls = self._calls, {}
            for call in calls.values():  # (an error each: one raised in every call's task would chain their frames)
                call._put(_unanswered(error) if not call.answered else _error(error.code(), error.details()))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
