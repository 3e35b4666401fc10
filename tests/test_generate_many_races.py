"""GenerateMany's races, driven step by step (verifier/generate_many.py with a recording engine loop in place of the
model, so that outputs arrive exactly when a test says): a key used again after a cancel gets only its new
generation's outputs, never those its earlier one had in flight; cancelling the last generation of a draining stream
ends the stream at once (the server's grace is not spent waiting); a start the engine loop throws on is refused alone
and the stream goes on; a refusal reaches only the start it answers (not one the caller cancelled or started again);
a start that fails while its submission is built still ends its span."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from unittest import mock

import grpc

from tandem.engine.request import FinishReason
from tandem.engine.step import StepOutput
from tandem.rpc.verifier.v1 import verifier_pb2 as pb
from verifier import generate_many
from verifier.server import VerifierService


class _RecordingLoop:
    """The engine loop's submit/cancel, recorded; outputs come when the test pushes them through a submission's sink."""

    def __init__(self, fail_prompt: int | None = None):
        self.subs, self.cancelled, self.fail_prompt = [], [], fail_prompt

    def submit(self, sub):
        if sub.prompt[0] == self.fail_prompt:
            raise RuntimeError("the engine loop broke on this one")
        self.subs.append(sub)
        sub.added.set_result(None)
        return sub.added

    def cancel(self, rid, sub=None):
        self.cancelled.append(rid)


def _service(loop) -> VerifierService:
    service = VerifierService.__new__(VerifierService)  # (no model: the conversions need only these)
    service.cfg = SimpleNamespace(internal_secret=None, drafter=None)
    service.context, service.speculative, service.default_spec = 4096, False, None
    service.loop, service.draining, service.on_drain = loop, False, set()
    return service


class _Context:
    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise grpc.aio.AbortError(f"{code} {details}")


def _start(key: int, rid: str, prompt=(5, 6)) -> pb.GenerateCommand:
    return pb.GenerateCommand(key=key, start=pb.GenerateRequest(request_id=rid, prompt_token_ids=list(prompt),
                                                               sampling=pb.SamplingParams(max_new_tokens=8)))


async def _session(service, script):
    """Run the stream with commands from ``script(send, loop)``; → its events, whether it ended by itself."""
    commands: asyncio.Queue = asyncio.Queue()
    batches = []

    async def feed():
        while (command := await commands.get()) is not None:
            yield command

    async def run():
        async for batch in generate_many.generate_many(service, feed(), _Context()):
            batches.append(batch)

    task = asyncio.create_task(run())
    await script(commands.put_nowait, service.loop)
    await asyncio.sleep(0.05)
    ended = task.done()
    commands.put_nowait(None)
    await asyncio.wait_for(task, 2)
    _session.batches = batches  # (the last session's messages, for a test that counts them)
    return [e for b in batches for e in b.events], ended


def _out(rid, tokens, final=False) -> StepOutput:
    return StepOutput(rid, list(tokens), FinishReason.LENGTH if final else None)


def test_a_key_used_again_after_a_cancel_gets_only_its_new_generations_outputs():
    async def script(send, loop):
        send(_start(7, "old"))
        await asyncio.sleep(0.05)
        old = loop.subs[0]
        old.sink(_out("old", [100]))
        await asyncio.sleep(0.05)
        send(pb.GenerateCommand(key=7, cancel=True))
        send(_start(7, "new"))
        await asyncio.sleep(0.05)
        old.sink(_out("old", [101, 102], final=True))  # in flight when the engine took the cancel
        loop.subs[1].sink(_out("new", [1], final=True))

    events, _ = asyncio.run(_session(_service(_RecordingLoop()), script))
    assert [(e.response.request_id, list(e.response.token_ids)) for e in events] == [("old", [100]), ("new", [1])]


def test_cancelling_the_last_generation_of_a_draining_stream_ends_it_at_once():
    async def script(send, loop):
        send(_start(1, "a"))
        await asyncio.sleep(0.05)
        loop.subs[0].sink(_out("a", [3]))
        await asyncio.sleep(0.05)
        service.drain()
        send(pb.GenerateCommand(key=1, cancel=True))  # nothing of "a" comes after this

    service = _service(_RecordingLoop())
    events, ended = asyncio.run(_session(service, script))
    assert ended and service.loop.cancelled == ["a"] and len(events) == 1


def test_a_start_the_engine_loop_throws_on_is_refused_alone():
    async def script(send, loop):
        send(_start(1, "bad", prompt=(9, 9)))
        send(_start(2, "good"))
        await asyncio.sleep(0.05)
        loop.subs[0].sink(_out("good", [4], final=True))

    events, _ = asyncio.run(_session(_service(_RecordingLoop(fail_prompt=9)), script))
    assert [(e.key, e.error.code) for e in events if e.HasField("error")] == [(1, grpc.StatusCode.UNKNOWN.value[0])]
    assert [list(e.response.token_ids) for e in events if e.key == 2] == [[4]]


def test_a_backlog_goes_in_batches_of_at_most_max_batch_tokens_paced_or_not():
    from verifier.generate_many import MAX_BATCH_TOKENS

    for interval_us in (0, 100_000):
        async def script(send, loop):
            send(_start(1, "a"))
            send(pb.GenerateCommand(message_interval_us=interval_us))
            await asyncio.sleep(0.05)
            sub = loop.subs[0]
            sub.sink(_out("a", [0]))  # (the first output goes at once)
            await asyncio.sleep(0.05)
            for i in range(1, 201):  # a backlog: 200 steps of 1000 tokens queued behind a slow write
                sub.sink(_out("a", [i] * 1000, final=i == 200))

        events, _ = asyncio.run(_session(_service(_RecordingLoop()), script))
        per_batch = [sum(len(e.response.token_ids) for e in b.events) for b in _session.batches]
        assert max(per_batch) <= MAX_BATCH_TOKENS + 1000 and len(per_batch) >= 4, (interval_us, per_batch)
        tokens = [t for e in events for t in e.response.token_ids]
        assert tokens == [0] + [i for i in range(1, 201) for _ in range(1000)]


def test_a_refusal_reaches_only_the_start_it_answers():
    async def script(send, loop):
        # all in one burst: the first start's refusal is still queued when the caller cancels it and starts key 1 again
        send(pb.GenerateCommand(key=1, start=pb.GenerateRequest(request_id="bad", prompt_token_ids=[5],
                                                                sampling=pb.SamplingParams(max_new_tokens=0))))
        send(pb.GenerateCommand(key=1, cancel=True))
        send(_start(1, "new"))
        send(_start(2, "b"))
        send(_start(2, "b-again"))  # a second start of a running key: refused, the first runs on
        await asyncio.sleep(0.05)
        loop.subs[0].sink(_out("new", [1], final=True))
        loop.subs[1].sink(_out("b", [2], final=True))

    events, _ = asyncio.run(_session(_service(_RecordingLoop()), script))
    assert [(e.key, e.error.code) for e in events if e.HasField("error")] == [(2, grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    assert [(e.key, e.response.request_id, list(e.response.token_ids)) for e in events if e.HasField("response")] == [
        (1, "new", [1]), (2, "b", [2])]


def test_a_start_whose_submission_cannot_be_built_is_refused_and_its_span_ended():
    span = mock.MagicMock()
    service = _service(_RecordingLoop())
    service.request_span = lambda rid, request, parent: span
    service.submission = mock.Mock(side_effect=RuntimeError("no submission"))

    async def script(send, loop):
        send(_start(1, "a"))

    events, _ = asyncio.run(_session(service, script))
    assert [(e.key, e.error.code) for e in events] == [(1, grpc.StatusCode.UNKNOWN.value[0])]
    span.end.assert_called_once()


def test_a_refused_submission_ends_its_span():
    spans = []
    service = _service(_RecordingLoop(fail_prompt=9))
    service.request_span = lambda rid, request, parent: spans.append(mock.MagicMock()) or spans[-1]

    async def script(send, loop):
        send(_start(1, "bad", prompt=(9, 9)))  # the engine loop throws on its submission: refused, UNKNOWN

    events, _ = asyncio.run(_session(service, script))
    assert [(e.key, e.error.code) for e in events] == [(1, grpc.StatusCode.UNKNOWN.value[0])]
    spans[0].end.assert_called_once()



def test_a_second_start_of_a_key_and_the_first_ones_own_refusal_both_reach_the_caller():
    """Both queued before the stream's next message (one batch): the second start's refusal must not use up the
    first generation's bookkeeping, whose own refusal (the engine loop's queue full) then has to go out too."""
    from verifier.engine_api import QueueFull

    class HeldLoop(_RecordingLoop):
        def submit(self, sub):
            self.subs.append(sub)
            return sub.added  # (answered below)

    async def run():
        loop = HeldLoop()
        stream = generate_many._Stream(_service(loop), _Context())
        stream._start(_start(1, "a"))
        stream._start(_start(1, "again"))  # refused at once: key 1 runs
        first = loop.subs[0]
        first.added.set_running_or_notify_cancel()
        first.added.set_exception(QueueFull("the waiting queue is full"))
        await asyncio.sleep(0.01)  # (the admission's callback)
        items = []
        while not stream.queue.empty():
            items.append(stream.queue.get_nowait())
        return await stream._events(items)

    events = asyncio.run(run())
    assert sorted(e.error.code for e in events) == sorted([grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                                           grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]])
