"""A gateway told to stop lets streams finish within its grace period and ends the ones still running after it with an
error event the client can act on (then [DONE]), never by dropping the connection mid-answer."""

from __future__ import annotations

import json
import threading

import httpx
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


def test_streams_running_past_the_grace_period_end_with_an_error_event():
    stack = Stack(shutdown_grace_s=1.0)
    try:
        stack.fake.delay_s = 0.05
        short, long, whole = [], [], []
        threads = [threading.Thread(target=_stream, args=(stack, n, events)) for n, events in ((6, short), (400, long))]
        threads.append(threading.Thread(target=_whole, args=(stack, 400, whole)))
        for t in threads:
            t.start()
        wait_until(lambda: len(long) >= 2, what="the long stream to start")
        stack.gateway.request_stop()  # (as SIGTERM does)
        for t in threads:
            t.join(15)
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
