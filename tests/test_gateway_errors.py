"""Bad input is a 4xx in the OpenAI error shape naming the field; verifier refusals keep their
meaning (400, 429, 503); the gateway keeps serving after each."""

from __future__ import annotations

import time

import grpc
import httpx
import openai
import pytest
from gateway_harness import MODEL_NAME, Stack, stack_fixture

GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


stack = stack_fixture(max_tokens_limit=300)


def _assert_still_serving(stack):
    r = httpx.post(f"{stack.url}/v1/completions", json=GOOD, timeout=10)
    assert r.status_code == 200, r.text


BAD_COMPLETIONS = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": ["a", 7]}, "prompt"),  # neither token ids nor a batch of prompts
    ({"prompt": ["a", ""]}, "prompt"),  # a batch with an empty prompt
    ({"prompt": ["a"] * 65}, "prompt"),  # a batch past MAX_PROMPTS
    ({"prompt": ["a", "b"], "n": 40}, "n"),  # prompts x n past MAX_PROMPTS
    ({"prompt": [1, 100000]}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 301}, "max_tokens"),  # over --max-tokens-limit
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"n": 17}, "n"),  # n and echo are implemented (test_gateway_openai_extras.py): out of range, wrong type
    ({"echo": "yes"}, "echo"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # chat's field
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 4}, "min_tokens"),  # over max_tokens
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"best_of": 3}, "best_of"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"stop_token_ids": ["x"]}, "stop_token_ids"),
]


@pytest.mark.parametrize("patch,field", BAD_COMPLETIONS, ids=[f"{f}={p[f]!r}"[:40] for p, f in BAD_COMPLETIONS])
def test_bad_completion_field_is_a_400_naming_it(stack, patch, field):
    r = httpx.post(f"{stack.url}/v1/completions", json={**GOOD, **patch}, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error
    assert error["type"] == "BadRequestError" and error["code"] == 400


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"logprobs": 3}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto: no tool-call parser
    ({"top_p": -1}, "top_p"),
]


@pytest.mark.parametrize("patch,field", BAD_CHATS, ids=[f for _, f in BAD_CHATS])
def test_bad_chat_field_is_a_400_naming_it(stack, patch, field):
    r = httpx.post(f"{stack.url}/v1/chat/completions", json={**CHAT, **patch}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(field)
    _assert_still_serving(stack)


def test_malformed_json_and_non_objects_are_400(stack):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        r = httpx.post(f"{stack.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        assert "JSON" in r.json()["error"]["message"]
    _assert_still_serving(stack)


def test_openai_client_sees_the_field_in_the_error(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=0)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    assert e.value.body["param"] == "model" and "gpt-4" in e.value.body["message"]


def test_context_overflow_names_the_numbers(stack):
    long_prompt = list(range(3, 3 + 500))  # the fake's context is 512
    r = httpx.post(f"{stack.url}/v1/completions", json={**GOOD, "prompt": long_prompt, "max_tokens": 20})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "512" in r.json()["error"]["message"] and "500 in the prompt" in r.json()["error"]["message"]
    too_long = list(range(3, 3 + 512))
    r = httpx.post(f"{stack.url}/v1/completions", json={**GOOD, "prompt": too_long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # Without max_tokens, the default shrinks to what fits instead of failing.
    r = httpx.post(f"{stack.url}/v1/completions", json={"prompt": list(range(3, 3 + 508))})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_a_long_text_prompt_is_tokenized_off_the_loop_and_still_checked(stack, monkeypatch):
    import threading

    from gateway.request import OFFLOAD_PARSE_BYTES

    tokenizer = stack.gateway.tokenizer
    threads = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode",
                        lambda text, **kw: threads.append(threading.current_thread()) or encode(text, **kw))
    text = "def f(x):\n    return x\n" * (OFFLOAD_PARSE_BYTES // 20)  # over the size that moves parsing to a thread
    r = httpx.post(f"{stack.url}/v1/completions", json={**GOOD, "prompt": text})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "512" in r.json()["error"]["message"]
    r = httpx.post(f"{stack.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = httpx.post(f"{stack.url}/v1/completions", json={**GOOD, "prompt": "short"})  # small: stays on the loop
    assert r.status_code == 200, r.text
    loop_thread = stack._thread
    assert len(threads) == 3 and threads[0] is not loop_thread and threads[1] is not loop_thread
    assert threads[2] is loop_thread


@pytest.mark.parametrize("stream", [False, True])
def test_verifier_refusals_map_to_http_statuses(stack, client, stream):
    cases = [(grpc.StatusCode.INVALID_ARGUMENT, "prompt: longer than the verifier allows", openai.BadRequestError, 400),
             (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (64 waiting)", openai.RateLimitError, 429),
             (grpc.StatusCode.UNAVAILABLE, "warming up at 10.0.0.7:50051", openai.InternalServerError, 503),
             (grpc.StatusCode.INTERNAL, "engine failed: RuntimeError('/models/x')", openai.InternalServerError, 500)]
    for code, message, exc, status in cases:
        stack.fake.fail_with = (code, message)
        with pytest.raises(exc) as e:
            r = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3, stream=stream)
            list(r)
        assert e.value.status_code == status
        if status < 500:  # the verifier's words for the client's own mistake or a full queue
            assert message in str(e.value)
        else:  # a 5xx never shows internal addresses, paths or exception texts
            assert message not in str(e.value) and "127.0.0.1" not in str(e.value) and "Error(" not in str(e.value)
    _assert_still_serving(stack)


def test_unknown_route_and_method_use_the_error_shape(stack):
    r = httpx.get(f"{stack.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.get(f"{stack.url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "MethodNotAllowedError"
    assert r.headers["allow"] == "POST"


def test_verifier_down_is_503_and_health_says_so():
    with socket_port() as port:  # nothing listens there
        s = Stack(verifier=f"127.0.0.1:{port}")
        try:
            assert httpx.get(f"{s.url}/health").status_code == 503
            r = httpx.post(f"{s.url}/v1/completions", json=GOOD, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
            assert httpx.get(f"{s.url}/v1/models").json()["data"][0]["id"] == MODEL_NAME
        finally:
            s.close()


def test_health_says_503_as_soon_as_a_generation_finds_the_verifier_unavailable():
    """/health mirrors the verifier's health every health_poll_s; a generation that finds the verifier unavailable
    meanwhile (killed: requests already get 503) turns it 503 at once, and the next health check that reaches a
    serving verifier turns it back."""
    s = Stack(health_poll_s=0.5)
    try:
        deadline = time.monotonic() + 10
        while httpx.get(f"{s.url}/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        s.fake.fail_with = (grpc.StatusCode.UNAVAILABLE, "connection refused")
        assert httpx.post(f"{s.url}/v1/completions", json=GOOD, timeout=10).status_code == 503
        assert httpx.get(f"{s.url}/health").status_code == 503  # at once, not at the next check
        while httpx.get(f"{s.url}/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{s.url}/health").status_code == 200  # the fake serves: the next check says so
    finally:
        s.close()


class socket_port:
    """A port that was free a moment ago (bound then released), for 'nobody listens here'."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        return None
