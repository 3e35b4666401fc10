"""A gateway told to stop lets streams finish within its grace period and ends the ones still running after it with an
error event the client can act on (then [DONE]), never by dropping the connection mid-answer."""

from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest
from gateway_harness import MODEL_NAME, Stack, wait_until


def _stream(stack, max_tokens: int, events: list) -> None:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))


def _whole(stack, max_tokens: int, answers: list) -> None:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": max_tokens}
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
    answers.append((r.status_code, r.json()))


def test_streams_running_past_the_grace_period_end_with_an_error_event(caplog):
    stack = Stack(shutdown_grace_s=1.0)
    try:
        stack.fake.delay_s = 0.05
        short, long, whole = [], [], []
        threads = [threading.Thread(target=_stream, args=(stack, n, events)) for n, events in ((6, short), (400, long))]
        threads.append(threading.Thread(target=_whole, args=(stack, 400, whole)))
        for t in threads:
            t.start()
        wait_until(lambda: len(long) >= 2, what="the long stream to start")
        with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
            stack.gateway.request_stop()  # (as SIGTERM does)
            for t in threads:
                t.join(15)
        # the expected end of a stop with streams running: a warning saying what happens, not uvicorn's ERROR
        said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "uvicorn.error"]
        assert ("WARNING", "shutdown: the grace period is over; 2 request(s) still running are cut short (each client "
                           "is told to retry)") in said, said
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], said
        assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
        assert long[-1] == "[DONE]", long[-3:]
        error = json.loads(long[-2])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
        assert all("error" not in json.loads(e) for e in long[:-2])
        (status, answer), = whole  # a whole answer still being made: a 503 the client can act on, not uvicorn's 500
        assert status == 503 and "shutting down" in answer["error"]["message"]
    finally:
        stack.fake.delay_s = 0.0
        stack.close()


def test_grpc_generations_drain_beside_rest_and_end_unavailable_past_the_grace_period():
    """Told to stop, the public gRPC API refuses new calls at once and gives its generations the same grace period
    as REST's, at the same time; one still running near its end is ended UNAVAILABLE with the reason (a status
    clients retry), not CANCELLED, which reads as the client's own doing."""
    import signal
    import time

    import grpc

    from tandem.rpc.generation.v1 import generation_pb2 as pb
    from tandem.rpc.generation.v1 import generation_pb2_grpc

    stack = Stack(shutdown_grace_s=2.0)
    try:
        stack.fake.delay_s = 0.05
        with grpc.insecure_channel(stack.grpc_target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            short = stub.Generate(pb.GenerateRequest(model=MODEL_NAME, text="hello", max_tokens=8), timeout=30)
            long = stub.Generate(pb.GenerateRequest(model=MODEL_NAME, text="hello", max_tokens=400), timeout=30)
            next(long)
            next(short)
            stopped_at = time.monotonic()
            stack.gateway._http.handle_exit(signal.SIGTERM, None)  # uvicorn's own handler: it holds the signals
            time.sleep(0.2)
            with pytest.raises(grpc.RpcError) as refused:  # no new work while draining
                list(stub.Generate(pb.GenerateRequest(model=MODEL_NAME, text="hi", max_tokens=2), timeout=5))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert [r.finish_reason for r in short][-1] == "length"  # a short one finishes within the grace
            with pytest.raises(grpc.RpcError) as cut:
                for _ in long:
                    pass
            took = time.monotonic() - stopped_at
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in cut.value.details()
            assert 0.5 <= took < 2.5, took  # within the grace period, not after REST's and its own
    finally:
        stack.fake.delay_s = 0.0
        stack.close()


def test_a_client_that_leaves_during_the_grace_period_is_counted_as_gone_not_as_cut_short():
    """While the server drains, a client that closes its stream is counted 499 (it left), not 503 (the server's cut)."""
    import time

    from gateway_harness import metric_value

    stack = Stack(shutdown_grace_s=3.0)
    try:
        stack.fake.delay_s = 0.05

        def counted(status: str) -> float:
            return metric_value(stack.gateway.metrics.render().decode(), "tandem:requests_total", api="completions",
                                status=status)

        before = counted("499"), counted("503")
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 400, "stream": True}
        with httpx.Client(timeout=30) as client, client.stream("POST", f"{stack.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            stack.gateway.request_stop()
            time.sleep(0.3)
        wait_until(lambda: counted("499") > before[0], what="the request counted")
        assert counted("503") == before[1]
    finally:
        stack.fake.delay_s = 0.0
        stack.close()
