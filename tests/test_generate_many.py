"""Many generations over one GenerateMany stream (verifier/generate_many.py), against a real verifier process on the
demo target: each gets exactly the tokens its own Generate stream gives (greedy), a step's tokens for several of them
travel in one message, a refused start fails only its own key, a cancel frees its generation (the stream ends soon
after the caller closes its side), the caller going cancels what still runs, and the internal secret guards it as it
guards Generate. The gateway's side (gateway/upstream_many.py) against a stand-in server: a stream that fails fails
its calls with its status, and the next start opens a new one; and over REST, one gateway of each kind in front of
the same verifier answers the same."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services import Service, free_port, gateway_service, prompts_of, read_metrics, wait_for
from tandem import internal_secret
from tandem.rpc.verifier.v1 import verifier_pb2 as pb
from tandem.rpc.verifier.v1 import verifier_pb2_grpc as pb_grpc

OPENED = "the generations go over one stream to the verifier"  # (gateway/upstream_many.py's line)
SECRET = "many-generations-secret-" + "z" * 8
AUTH = ((internal_secret.METADATA_KEY, SECRET),)


@pytest.fixture(scope="module")
def target_dir():
    from tandem.training import demo

    return demo.SHIPPED / "target"


@pytest.fixture(scope="module")
def verifier(target_dir, tmp_path_factory):
    metrics_port = free_port()
    service = Service("verifier", ["--model", str(target_dir), "--metrics-port", str(metrics_port)], free_port(),
                      tmp_path_factory.mktemp("logs") / "verifier.log", env={internal_secret.ENV: SECRET}).start()
    service.metrics_port = metrics_port
    yield service
    service.stop()


def _start(key: int, prompt: list[int], max_new_tokens: int) -> pb.GenerateCommand:
    return pb.GenerateCommand(key=key, start=pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        max_new_tokens=max_new_tokens, ignore_eos=True)))


def _one_by_one(address: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
            max_new_tokens=max_new_tokens, ignore_eos=True))
        return [t for message in stub.Generate(request, metadata=AUTH, timeout=120) for t in message.token_ids]


async def _many(address: str, commands, on_event=None, metadata=AUTH) -> list[pb.GenerateBatch]:
    """Send ``commands`` (a list, or an async iterator), read batches until the server ends the stream."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.VerifierStub(channel)

        async def listed():
            for command in commands:
                yield command

        call = stub.GenerateMany(listed() if isinstance(commands, list) else commands, metadata=metadata, timeout=120)
        batches = []
        async for batch in call:
            batches.append(batch)
            for event in batch.events:
                if on_event is not None:
                    await on_event(event)
        return batches


def test_each_generation_gets_its_own_streams_tokens_and_a_step_carries_several(verifier):
    prompts = prompts_of(6)
    lengths = [24, 40, 16, 40, 32, 8]
    batches = asyncio.run(_many(verifier.address, [_start(10 + i, p, n) for i, (p, n) in enumerate(zip(prompts, lengths))]))
    got = {10 + i: [] for i in range(6)}
    finals = {}
    for batch in batches:
        for event in batch.events:
            assert event.HasField("response"), event
            got[event.key] += event.response.token_ids
            if event.response.finish_reason:
                finals[event.key] = event.response
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        assert got[10 + i] == _one_by_one(verifier.address, prompt, n)
        assert finals[10 + i].finish_reason == "length" and finals[10 + i].completion_tokens == n
        assert finals[10 + i].prompt_tokens == len(prompt)
    assert max(len(b.events) for b in batches) >= 2  # a step's outputs of several generations in one message
    assert len(batches) < sum(lengths)


def test_a_refused_start_fails_only_its_own_key(verifier):
    bad = pb.GenerateCommand(key=2, start=pb.GenerateRequest(prompt_token_ids=[], sampling=pb.SamplingParams(
        max_new_tokens=4)))
    batches = asyncio.run(_many(verifier.address, [_start(1, [5, 6, 7], 12), bad, _start(2, [5, 6], 3)]))
    events = [e for b in batches for e in b.events]
    errors = [e for e in events if e.HasField("error")]
    assert [(e.key, e.error.code) for e in errors] == [(2, grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    assert "prompt is empty" in errors[0].error.message
    assert sum(len(e.response.token_ids) for e in events if e.key == 1) == 12
    # key 2 was free again after its refusal: the second start under it ran
    assert sum(len(e.response.token_ids) for e in events if e.key == 2 and e.HasField("response")) == 3


def test_a_cancel_frees_its_generation_and_the_stream_ends_when_the_rest_are_done(verifier):
    async def scenario():
        commands: asyncio.Queue = asyncio.Queue()
        for command in (_start(1, [9, 8, 7], 240), _start(2, [3, 4], 20)):
            commands.put_nowait(command)
        seen = {1: 0, 2: 0}

        async def feed():
            while (command := await commands.get()) is not None:
                yield command

        async def on_event(event):
            seen[event.key] += len(event.response.token_ids)
            if event.key == 1 and seen[1] >= 8 and not cancelled:
                cancelled.append(True)
                commands.put_nowait(pb.GenerateCommand(key=1, cancel=True))
            if event.key == 2 and event.response.finish_reason:
                commands.put_nowait(None)  # our side closed: the stream ends once nothing runs

        cancelled: list = []
        started = time.monotonic()
        await asyncio.wait_for(_many(verifier.address, feed(), on_event), 60)
        return seen, time.monotonic() - started

    aborted = _aborted(verifier)
    seen, took = asyncio.run(scenario())
    assert seen[2] == 20 and 8 <= seen[1] < 240
    wait_for(lambda: _aborted(verifier) == aborted + 1, 10, "the cancelled generation to be aborted")


def test_a_pace_command_sends_what_comes_within_the_interval_together(verifier):
    def batches(interval_us: int) -> int:
        pace = pb.GenerateCommand(message_interval_us=interval_us)
        got = asyncio.run(_many(verifier.address, [_start(1, [5, 6, 7], 60), _start(2, [8, 9], 60), pace]))
        assert sum(len(e.response.token_ids) for b in got for e in b.events) == 120
        return len(got)

    unpaced, paced = batches(0), batches(1_000_000)  # (a second: longer than the generations take here)
    assert unpaced >= 20 and paced <= 4  # the first outputs and the finishes never wait


def _aborted(verifier) -> float:
    return read_metrics(verifier.metrics_port).get('tandem:request_success_total{finished_reason="abort"}', 0.0)


def test_the_caller_going_cancels_what_still_runs(verifier):
    aborted = _aborted(verifier)

    async def scenario():
        async with grpc.aio.insecure_channel(verifier.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            call = stub.GenerateMany(iter([_start(1, [4, 4, 4], 240), _start(2, [5, 5], 240)]), metadata=AUTH)
            tokens = 0
            async for batch in call:
                tokens += sum(len(e.response.token_ids) for e in batch.events)
                if tokens >= 10:
                    call.cancel()
                    break

    asyncio.run(scenario())
    wait_for(lambda: _aborted(verifier) == aborted + 2, 10, "the caller's two generations to be aborted")


def test_the_stream_needs_the_internal_secret(verifier):
    async def wait_then_start():
        # Our side stays open and writes nothing the refusal could race: a start written as the server ends the stream
        # can fail in gRPC's core first (INTERNAL, "Failed execute_batch"), which hid the refusal once in CI.
        await asyncio.sleep(30)
        yield _start(1, [5, 6], 4)

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(_many(verifier.address, wait_then_start(), metadata=()))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_over_rest_one_stream_and_a_stream_each_answer_the_same(verifier, target_dir, tmp_path):
    gateways = []
    for kind in ("one", "per-request"):
        gateway = gateway_service(verifier.address, target_dir, "demo", tmp_path / f"gateway-{kind}.log")
        gateway.args += ["--upstream-streams", kind]
        gateway.env[internal_secret.ENV] = SECRET
        gateways.append(gateway.start())
    try:
        def complete(url: str, prompt: str) -> str:
            body = json.dumps({"prompt": prompt, "max_tokens": 24, "temperature": 0}).encode()
            request = urllib.request.Request(f"{url}/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as reply:
                return json.load(reply)["choices"][0]["text"]

        prompts = [f"def function_{i}(x):\n    return" for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            answers = [list(pool.map(lambda p, g=g: complete(g.url, p), prompts)) for g in gateways]
        assert answers[0] == answers[1] and all(answers[0])
        assert OPENED in gateways[0].log() and OPENED not in gateways[1].log()
        assert "stream to the verifier ended" not in gateways[0].log()
    finally:
        for gateway in gateways:
            gateway.stop()


@contextlib.asynccontextmanager
async def _stand_in(generate_many):
    """A channel to a server whose GenerateMany is ``generate_many(commands, context)``."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("tandem.rpc.verifier.v1.Verifier", {
        "GenerateMany": grpc.stream_stream_rpc_method_handler(
            generate_many, request_deserializer=pb.GenerateCommand.FromString,
            response_serializer=pb.GenerateBatch.SerializeToString)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


def test_the_gateway_keeps_the_streams_pace_current_between_starts():
    from gateway.upstream_many import ManyStream

    async def scenario():
        asked = []

        async def generate_many(commands, context):  # each start: three batches of a token, 20 ms apart
            async for command in commands:
                if command.WhichOneof("command") == "message_interval_us":
                    asked.append(command.message_interval_us)
                    continue
                for i in range(3):
                    await asyncio.sleep(0.02)
                    yield pb.GenerateBatch(events=[pb.GenerateEvent(key=command.key, response=pb.GenerateResponse(
                        token_ids=[i], finish_reason="length" if i == 2 else ""))])

        async with _stand_in(generate_many) as channel:
            stub = pb_grpc.VerifierStub(channel)
            now = [0]  # what this gateway's load asks for (gateway/pacing.py), read at each batch received
            many = ManyStream(lambda commands: stub.GenerateMany(commands), lambda: now[0])

            def start():  # as VerifierClient.generate: the start carries the pace of the moment
                return many.start(pb.GenerateRequest(prompt_token_ids=[5], message_interval_us=now[0]), [])

            calls = [start()]
            for value in (40_000, 41_000, 0):  # at the 2nd batch 40 ms goes; at the 3rd 41 ms, within a quarter, stays
                await calls[0].read()
                now[0] = value
            calls.append(start())  # a start sets the stream's pace itself: nothing to send
            await calls[1].read()
            now[0] = 50_000
            for _ in range(2):
                await calls[1].read()
            await start().read()  # (its start follows the command sent before it)
            assert asked == [40_000, 50_000]
            await many.close()

    asyncio.run(scenario())


def test_the_gateways_calls_fail_with_their_streams_status_and_the_next_start_opens_a_new_stream():
    from gateway.upstream_many import ManyStream

    async def scenario():
        streams, traces = [], []

        async def generate_many(commands, context):
            streams.append(None)
            async for command in commands:
                traces.append(dict(command.trace_context))
                if command.start.prompt_token_ids[0] == 1:  # refused alone
                    yield pb.GenerateBatch(events=[pb.GenerateEvent(key=command.key, error=pb.GenerateError(
                        code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="queue full"))])
                    continue
                finish = "length" if len(streams) > 1 else ""
                yield pb.GenerateBatch(events=[pb.GenerateEvent(key=command.key, response=pb.GenerateResponse(
                    token_ids=[7, 8], finish_reason=finish))])
                if len(streams) == 1:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")

        async with _stand_in(generate_many) as channel:
            if True:
                stub = pb_grpc.VerifierStub(channel)
                many = ManyStream(lambda commands: stub.GenerateMany(commands))
                request = pb.GenerateRequest(prompt_token_ids=[5], sampling=pb.SamplingParams(max_new_tokens=2))
                first = many.start(request, [("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")])
                assert list((await first.read()).token_ids) == [7, 8]
                assert traces[0] == {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}  # the span's parent
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await first.read()
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
                second = many.start(request, [])  # a new stream
                reply = await second.read()
                assert list(reply.token_ids) == [7, 8] and reply.finish_reason == "length"
                assert await second.read() is grpc.aio.EOF and len(streams) == 2
                refused = many.start(pb.GenerateRequest(prompt_token_ids=[1]), [])
                with pytest.raises(grpc.aio.AioRpcError) as full:
                    await refused.read()
                assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and full.value.details() == "queue full"
                await many.close()

    asyncio.run(scenario())


def _drained(target_dir, tmp_path, on_event_of):
    """A verifier of its own; a GenerateMany stream whose side stays open, ``on_event_of(service, commands)`` called on
    each event → (the events, the seconds from the SIGTERM to the verifier's exit)."""
    service = Service("verifier", ["--model", str(target_dir)], free_port(), tmp_path / "verifier.log",
                      env={internal_secret.ENV: SECRET}).start()
    signalled = []

    async def scenario():
        commands: asyncio.Queue = asyncio.Queue()
        events = []

        async def feed():
            while (command := await commands.get()) is not None:
                yield command

        async def on_event(event):
            events.append(event)
            await on_event_of(event, events, commands, lambda: signalled.append(time.monotonic())
                              or service.proc.send_signal(signal.SIGTERM))

        commands.put_nowait(_start(1, [5, 6], 200))
        await asyncio.wait_for(_many(service.address, feed(), on_event), 30)  # (ended by the server: our side is open)
        return events

    try:
        events = asyncio.run(scenario())
        service.proc.wait(30)
        return events, time.monotonic() - signalled[0]
    finally:
        service.stop()


def test_a_draining_verifier_refuses_new_starts_and_ends_the_stream_when_its_generations_finish(target_dir, tmp_path):
    async def on_event(event, events, commands, drain):
        if event.key == 1 and len(events) == 5:  # key 1 still running: drain, then ask for more
            drain()
            await asyncio.sleep(0.3)
            commands.put_nowait(_start(2, [7, 8], 4))

    events, _ = _drained(target_dir, tmp_path, on_event)
    refused = [e for e in events if e.key == 2]
    assert len(refused) == 1 and refused[0].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "shutting down" in refused[0].error.message
    assert sum(len(e.response.token_ids) for e in events if e.key == 1) == 200  # the running one finished
    assert events[-1].response.finish_reason == "length"


def test_an_idle_stream_does_not_hold_the_verifiers_drain(target_dir, tmp_path):
    async def on_event(event, events, commands, drain):
        if event.response.finish_reason:  # nothing runs now; the stream stays open
            drain()

    _, exit_s = _drained(target_dir, tmp_path, on_event)
    assert exit_s < 4.0  # (the server's grace for open calls is 5 s)


def test_a_generation_the_verifier_never_answered_fails_as_unavailable_when_the_stream_ends_internally():
    """A start written as a draining verifier ends the stream fails in gRPC's core (INTERNAL, "Internal error from
    Core": the soak met it): nothing of it ran, so the gateway answers 503 (retry) for it, not 500; a generation that
    had been answered keeps the stream's status."""
    from gateway.upstream_many import ManyStream, _error

    async def scenario():
        async def stream(commands):
            async for command in commands:
                if command.key == 1:
                    yield pb.GenerateBatch(events=[pb.GenerateEvent(key=1, response=pb.GenerateResponse(token_ids=[7]))])
                else:
                    raise _error(grpc.StatusCode.INTERNAL, "Internal error from Core")

        many = ManyStream(stream)
        answered = many.start(pb.GenerateRequest(prompt_token_ids=[5]), [])
        assert list((await answered.read()).token_ids) == [7]
        unanswered = many.start(pb.GenerateRequest(prompt_token_ids=[6]), [])
        codes = []
        for call in (answered, unanswered):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await asyncio.wait_for(call.read(), 2)
            codes.append(failed.value.code())
        assert codes == [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE]
        await many.close()

    asyncio.run(scenario())


def test_cancelling_a_call_ends_a_read_waiting_in_another_task():
    from gateway.upstream_many import ManyStream

    async def scenario():
        async def generate_many(commands, context):  # answers nothing: the read waits
            async for _ in commands:
                pass

        async with _stand_in(generate_many) as channel:
            stub = pb_grpc.VerifierStub(channel)
            many = ManyStream(lambda commands: stub.GenerateMany(commands))
            call = many.start(pb.GenerateRequest(prompt_token_ids=[5]), [])
            reader = asyncio.create_task(call.read())
            await asyncio.sleep(0.05)
            call.cancel()  # (as gateway/choices.py cancels the other choices of a failed request)
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(reader, 2)
            await many.close()

    asyncio.run(scenario())
