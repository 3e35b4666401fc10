"""Every value range checked where it would otherwise break later (a 500, or silently another
meaning): lone surrogates, integers and floats past what the verifier's protobuf carries, absurd
JSON; 5xx bodies that say nothing internal; /v1/models without paths; a prompt the KV cache can
never hold is the client's 400, not a 429 to retry forever."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from gateway_harness import MODEL_NAME, Stack, stack_fixture

from tandem.rpc.generation.v1 import generation_pb2 as gen_pb
from tandem.rpc.generation.v1 import generation_pb2_grpc as gen_grpc

GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


stack = stack_fixture()


def _post(stack, raw: bytes, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=10)


@pytest.mark.parametrize("raw,path,field", [
    (b'{"prompt": "\\ud800", "max_tokens": 2}', "/v1/completions", "prompt"),
    (b'{"prompt": "ok \\udfff", "max_tokens": 2}', "/v1/completions", "prompt"),
    (b'{"prompt": "hi", "stop": ["\\ud800"]}', "/v1/completions", "stop"),
    (b'{"prompt": "hi", "model": "\\ud800"}', "/v1/completions", "model"),
    (b'{"messages": [{"role": "user", "content": "\\udbff"}]}', "/v1/chat/completions", "messages"),
    (b'{"messages": [{"role": "\\ud800", "content": "x"}]}', "/v1/chat/completions", "messages"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}', "/v1/chat/completions",
     "messages"),
])
def test_lone_surrogates_are_400_naming_the_field(stack, raw, path, field):
    r = _post(stack, raw, path)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and "surrogate" in r.json()["error"]["message"]


def test_surrogate_pairs_are_text(stack):
    r = _post(stack, b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("patch,field", [
    ({"top_k": 2 ** 31}, "top_k"),
    ({"top_k": 2 ** 63}, "top_k"),
    ({"top_p": 1e-50}, "top_p"),  # rounds to 0.0 as a float32, which the verifier reads as "unset" (1.0)
    ({"top_p": 1e-46}, "top_p"),
    ({"temperature": 1e300}, "temperature"),  # a finite double, inf as a float32
    ({"temperature": 1e39}, "temperature"),
    ({"temperature": 101}, "temperature"),
    ({"seed": 2 ** 64}, "seed"),
    ({"max_tokens": 2 ** 40}, "max_tokens"),
    ({"stop_token_ids": [2 ** 31]}, "stop_token_ids"),
    ({"prompt": [5, 2 ** 40]}, "prompt"),
])
def test_values_past_what_the_verifier_can_take_are_400(stack, patch, field):
    r = httpx.post(f"{stack.url}/v1/completions", json={**GOOD, **patch}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(field)


def test_the_largest_values_that_fit_are_served(stack):
    for patch in ({"top_k": 2 ** 31 - 1}, {"top_p": 1e-30}, {"temperature": 100}, {"seed": 2 ** 64 - 1}):
        r = httpx.post(f"{stack.url}/v1/completions", json={**GOOD, **patch}, timeout=10)
        assert r.status_code == 200, (patch, r.text)
    sent = stack.fake.requests[-4:]
    assert sent[0].sampling.top_k == 2 ** 31 - 1 and 0 < sent[1].sampling.top_p < 1e-29


@pytest.mark.parametrize("raw", [
    b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}',
    b'{"prompt": "x", "top_p": -Infinity}',
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # past Python's int-parsing limit: a ValueError
    b"[" * 200_000 + b"]" * 200_000,  # deeper than the parser recurses
    b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"prompt": "x"}\x00', b"\xef\xbb\xbf{}", b'{"a": 1, "a": "' + b"\xff" * 3 + b'"}',
])
def test_absurd_json_is_400(stack, raw):
    r = _post(stack, raw)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["code"] == 400


def test_grpc_non_finite_floats_are_invalid_argument(stack):
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = gen_grpc.GenerationStub(channel)
        for fields, name in (({"temperature": float("inf")}, "temperature"),
                             ({"temperature": float("nan")}, "temperature"), ({"top_p": float("nan")}, "top_p"),
                             ({"top_k": 2 ** 31 - 1, "top_p": 0.0}, "top_p")):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(gen_pb.GenerateRequest(text="hi", max_tokens=2, **fields), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(name)


def test_a_500_says_nothing_internal(stack, monkeypatch):
    secret = "RuntimeError at /srv/models/secret-llama from 10.1.2.3:50051"

    def boom(text):
        raise RuntimeError(secret)

    monkeypatch.setattr(stack.gateway.tokenizer, "encode", boom)
    for path, body in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)):
        r = httpx.post(f"{stack.url}{path}", json=body, timeout=10)
        assert r.status_code == 500
        error = r.json()["error"]
        assert error == {"message": "internal server error", "type": "InternalServerError", "param": None, "code": 500}
    with grpc.insecure_channel(stack.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as e:
            list(gen_grpc.GenerationStub(channel).Generate(gen_pb.GenerateRequest(text="hi", max_tokens=2), timeout=10))
    assert "secret" not in (e.value.details() or "") and "10.1.2.3" not in (e.value.details() or "")


def test_models_shows_the_served_name_and_no_path(stack):
    r = httpx.get(f"{stack.url}/v1/models", timeout=10)
    card = r.json()["data"][0]
    assert card["id"] == card["root"] == MODEL_NAME
    assert stack.model_dir not in r.text and "/tmp" not in r.text


def test_a_verifier_that_is_down_is_503_without_its_address():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = Stack(verifier=f"127.0.0.1:{port}")
    try:
        for r in (httpx.post(f"{s.url}/v1/completions", json=GOOD, timeout=10),
                  httpx.get(f"{s.url}/health", timeout=10)):
            assert r.status_code == 503
            assert str(port) not in r.text and "127.0.0.1" not in r.text and "ipv4" not in r.text
    finally:
        s.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_the_kv_cache_can_never_hold_is_400_not_429(stack, stream):
    never = "the prompt needs 40 KV pages and the whole KV cache has 32 for requests: it can never fit; shorten it"
    stack.fake.fail_with = (grpc.StatusCode.OUT_OF_RANGE, never)
    r = httpx.post(f"{stack.url}/v1/completions", json={**GOOD, "stream": stream}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "40" in r.text and "32" in r.text
    stack.fake.fail_with = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (256 waiting)")  # later may work: 429
    r = httpx.post(f"{stack.url}/v1/completions", json={**GOOD, "stream": stream}, timeout=10)
    assert r.status_code == 429, r.text
    assert json.loads(r.text)["error"]["type"] == "RateLimitError"
