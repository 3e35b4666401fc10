"""The verifier's gRPC port is part of the internal plane (tandem.internal_secret), tried as a local attacker would
over real sockets against a real verifier process started with a secret: Generate and GetModelInfo without it, or
with a wrong one, are UNAUTHENTICATED (the gateway's API key, limits and request log are not a port away), health
stays open; the gateway given the secret serves through it; a gateway without it says what to do; and a verifier
with no secret refuses to bind a non-loopback address."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request

import grpc
import pytest

from services import Service, free_port, gateway_service
from tandem import internal_secret
from tandem.rpc.verifier.v1 import verifier_pb2 as pb
from tandem.rpc.verifier.v1 import verifier_pb2_grpc as pb_grpc
from tandem.service_probe import is_serving

SECRET = "verifier-secret-for-tests-" + "y" * 8


@pytest.fixture(scope="module")
def target_dir():
    from tandem.training import demo

    return demo.SHIPPED / "target"  # (a tokenizer too: the gateway's)


@pytest.fixture(scope="module")
def verifier(target_dir, tmp_path_factory):
    service = Service("verifier", ["--model", str(target_dir)], free_port(),
                      tmp_path_factory.mktemp("logs") / "verifier.log", env={internal_secret.ENV: SECRET}).start()
    yield service
    service.stop()


def _calls(address: str, metadata) -> list:
    """GetModelInfo and a Generate of 4 tokens with ``metadata`` → each reply, or the error that ended it."""
    out = []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        for call in (lambda: stub.GetModelInfo(pb.ModelInfoRequest(), metadata=metadata, timeout=30),
                     lambda: list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(
                         max_new_tokens=4, ignore_eos=True)), metadata=metadata, timeout=60))):
            try:
                out.append(call())
            except grpc.RpcError as e:
                out.append(e)
    return out


@pytest.mark.parametrize("metadata", [(), ((internal_secret.METADATA_KEY, "wrong-" + SECRET),),
                                      ((internal_secret.METADATA_KEY, SECRET[:-1]),)])
def test_calls_without_the_secret_are_unauthenticated_and_health_stays_open(verifier, metadata):
    for reply in _calls(verifier.address, metadata):
        assert isinstance(reply, grpc.RpcError) and reply.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "internal secret" in reply.details()
    assert is_serving(verifier.port)  # (load balancers and compose's healthcheck need no secret)


def test_calls_with_the_secret_are_served(verifier):
    info, responses = _calls(verifier.address, ((internal_secret.METADATA_KEY, SECRET),))
    assert info.vocab_size > 0
    assert sum(len(r.token_ids) for r in responses) == 4


def test_a_gateway_without_the_secret_is_not_ready_and_says_why(verifier, caplog):
    from gateway.errors import GatewayError
    from gateway.upstream import VerifierClient

    async def model_info(secret):
        client = VerifierClient(verifier.address, 10.0, secret, one_stream=True)
        try:
            return await client.model_info()
        finally:
            await client.close()

    with caplog.at_level(logging.ERROR, logger="gateway.upstream"):
        with pytest.raises(GatewayError) as refused:
            asyncio.run(model_info(None))
    assert refused.value.status == 503
    assert internal_secret.ENV in caplog.text and "refused this gateway" in caplog.text
    assert asyncio.run(model_info(SECRET)).vocab_size > 0


def test_a_gateway_with_the_secret_serves_through_it(verifier, target_dir, tmp_path):
    gateway = gateway_service(verifier.address, target_dir, "t", tmp_path / "gateway.log")
    gateway.env[internal_secret.ENV] = SECRET
    gateway.start()
    try:
        body = json.dumps({"model": "t", "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}).encode()
        request = urllib.request.Request(gateway.url + "/completions", body, {"Content-Type": "application/json"})
        reply = json.load(urllib.request.urlopen(request, timeout=60))
        assert reply["usage"]["completion_tokens"] == 4
    finally:
        gateway.stop()


def test_without_a_secret_the_verifier_binds_loopback_only(target_dir, monkeypatch):
    from tandem.errors import ConfigError
    from verifier.__main__ import build_parser
    from verifier.config import VerifierConfig

    monkeypatch.delenv(internal_secret.ENV, raising=False)
    for host, refused in (("0.0.0.0", True), ("10.1.2.3", True), ("127.0.0.1", False), ("localhost", False)):
        args = build_parser().parse_args(["--model", str(target_dir), "--host", host])
        if refused:
            with pytest.raises(ConfigError, match=f"--host {host} is not a loopback address.*{internal_secret.ENV}"):
                VerifierConfig.from_args(args, args.model)
        else:
            assert VerifierConfig.from_args(args, args.model).internal_secret is None
    monkeypatch.setenv(internal_secret.ENV, SECRET)
    args = build_parser().parse_args(["--model", str(target_dir), "--host", "0.0.0.0"])
    assert VerifierConfig.from_args(args, args.model).internal_secret == SECRET
