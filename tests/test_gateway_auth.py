"""--api-key: /v1/* and the public gRPC API refuse requests without the key (401 in the OpenAI error
shape, UNAUTHENTICATED); /health, /metrics and gRPC health stay open; the key is compared in
constant time and never logged."""

from __future__ import annotations

import logging

import grpc
import httpx
import openai
import pytest
from gateway_harness import MODEL_NAME, Stack, metric_value, stack_fixture, tiny_model_dir, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import auth
from gateway.config import build_parser, config_from_args
from tandem.rpc.generation.v1 import generation_pb2 as gen_pb
from tandem.rpc.generation.v1 import generation_pb2_grpc as gen_grpc

KEY = "tk-0123456789abcdef"
GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}


stack = stack_fixture(api_key=KEY)


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", KEY, f"Basic {KEY}",
                                    "Bearer", ""])
def test_v1_without_the_key_is_401_in_the_openai_shape(stack, header):
    headers = {} if header is None else {"Authorization": header}
    before = len(stack.fake.requests)
    for method, path, body in (("POST", "/v1/completions", GOOD), ("GET", "/v1/models", None),
                               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                               ("GET", "/v1/no-such-route", None)):
        r = httpx.request(method, f"{stack.url}{path}", json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (path, r.text)
        assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "AuthenticationError",
                                      "param": None, "code": 401}}
        assert KEY not in r.text
    assert len(stack.fake.requests) == before, "a refused request reached the verifier"


def test_v1_with_the_key_is_served(stack):
    for header in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY}"):
        r = httpx.post(f"{stack.url}/v1/completions", json=GOOD, headers={"Authorization": header}, timeout=10)
        assert r.status_code == 200, (header, r.text)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0, timeout=10)
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="nope", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_health_and_metrics_stay_open(stack):
    assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200
    r = httpx.get(f"{stack.url}/metrics", timeout=10)
    assert r.status_code == 200 and "tandem:requests" in r.text


def test_grpc_needs_the_key_but_health_does_not(stack):
    request = gen_pb.GenerateRequest(model=MODEL_NAME, text="hello", max_tokens=3)
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = gen_grpc.GenerationStub(channel)
        for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", KEY),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request, metadata=metadata, timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and KEY not in e.value.details()
        replies = list(stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=10))
        assert replies[-1].completion_tokens == 3
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_refusals_are_counted_on_the_metrics(stack):
    """(A broken key rotation or someone guessing keys shows on the dashboards, not only in the access log.)"""
    def counted():
        text = httpx.get(f"{stack.url}/metrics", timeout=10).text
        return (metric_value(text, "tandem:requests_total", api="rest", status="401"),
                metric_value(text, "tandem:requests_total", api="grpc", status="UNAUTHENTICATED"))

    rest, grpc_ = counted()
    for _ in range(3):
        assert httpx.post(f"{stack.url}/v1/completions", json=GOOD, timeout=10).status_code == 401
    with grpc.insecure_channel(stack.grpc_target) as channel:
        with pytest.raises(grpc.RpcError):
            list(gen_grpc.GenerationStub(channel).Generate(gen_pb.GenerateRequest(text="x", max_tokens=1), timeout=10))
    assert counted() == (rest + 3, grpc_ + 1)


def test_no_key_configured_means_open():
    s = Stack()
    try:
        assert httpx.post(f"{s.url}/v1/completions", json=GOOD, timeout=10).status_code == 200
    finally:
        s.close()


def test_the_key_comes_from_the_flag_or_the_environment_and_is_not_printed(monkeypatch):
    argv = ["--verifier", "127.0.0.1:1", "--model-dir", str(tiny_model_dir())]
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert config_from_args(build_parser().parse_args(argv)).api_key is None
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    assert config_from_args(build_parser().parse_args(argv)).api_key == "from-env"
    cfg = config_from_args(build_parser().parse_args(argv + ["--api-key", "from-flag"]))
    assert cfg.api_key == "from-flag" and "from-flag" not in repr(cfg)
    for bad in ("", "two words", "k\u00e9y"):
        with pytest.raises(ValueError):
            config_from_args(build_parser().parse_args(argv + ["--api-key", bad]))


def test_the_comparison_is_constant_time(monkeypatch):
    calls = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    assert auth.bearer_matches(f"Bearer {KEY}", KEY.encode())
    assert not auth.bearer_matches("Basic " + KEY, KEY.encode())  # a wrong scheme still goes through it
    assert not auth.bearer_matches(None, KEY.encode())
    assert calls == [(KEY.encode(), KEY.encode())] * 2


def test_refused_requests_leave_an_access_log_line(stack, caplog):
    """Every HTTP request has a line (uvicorn's access log, on by default as in vLLM): a refusal never reaches the
    request log, so this is where an operator sees 401s; the key never appears in it."""
    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        r = httpx.post(f"{stack.url}/v1/completions", json=GOOD, headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert r.status_code == 401
        wait_until(lambda: any("/v1/completions" in m and "401" in m for m in caplog.messages), what="an access line")
    assert KEY not in caplog.text


def test_the_access_log_can_be_turned_off():
    argv = ["--verifier", "127.0.0.1:1", "--model-dir", str(tiny_model_dir())]
    assert config_from_args(build_parser().parse_args(argv)).access_log
    assert not config_from_args(build_parser().parse_args([*argv, "--disable-uvicorn-access-log"])).access_log


def test_a_malformed_body_without_the_key_is_unauthenticated(stack):
    """Refused for the key, not decoded first (gRPC's UNKNOWN and a logged traceback per call, to anyone)."""
    with grpc.insecure_channel(stack.grpc_target) as channel:
        raw = channel.unary_stream("/tandem.rpc.generation.v1.Generation/Generate",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
        for metadata, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                               ((("authorization", f"Bearer {KEY}"),), grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as e:
                list(raw(b"\xff" * 50, metadata=metadata, timeout=10))
            assert e.value.code() == code, e.value.details()


@pytest.mark.parametrize("host, key, open_to_all", [("127.0.0.1", None, False), ("::1", None, False),
                                                    ("localhost", None, False), ("0.0.0.0", None, True),
                                                    ("0.0.0.0", "k1", False), ("10.0.0.5", None, True)])
def test_an_api_served_past_loopback_without_a_key_is_named_at_start(host, key, open_to_all, tmp_path):
    """compose's TANDEM_BIND=0.0.0.0 without TANDEM_API_KEY served anyone silently (the verifier and the drafter
    refuse the like without their secret): the gateway says so when it is ready (gateway/server.py)."""
    from gateway.config import GatewayConfig

    assert GatewayConfig(verifier="x:1", model_dir=str(tmp_path), host=host, api_key=key).open_to_all is open_to_all
