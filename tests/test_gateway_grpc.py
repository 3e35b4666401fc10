"""The public gRPC API (tandem.rpc.generation.v1.Generation): the same tokens and text as REST,
INVALID_ARGUMENT naming the field, cancellation reaching the verifier, health and reflection."""

from __future__ import annotations

import grpc
import httpx
import pytest
from gateway_harness import MODEL_NAME, metric_value, stack_fixture, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.rpc.generation.v1 import generation_pb2 as pb
from tandem.rpc.generation.v1 import generation_pb2_grpc


stack = stack_fixture()


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(stack.grpc_target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return generation_pb2_grpc.GenerationStub(channel)


def test_text_prompt_streams_the_verifier_tokens_and_their_text(stack, stub):
    prompt = "import os\n"
    replies = list(stub.Generate(pb.GenerateRequest(model=MODEL_NAME, text=prompt, max_tokens=25), timeout=10))
    prompt_ids = stack.tok.encode(prompt)
    expected = stack.expected(prompt_ids, 25)
    assert [t for r in replies for t in r.token_ids] == expected
    assert "".join(r.text for r in replies) == stack.tok.decode(expected)
    assert [r.finish_reason for r in replies] == [""] * (len(replies) - 1) + ["length"]
    assert len(replies) > 1 and len({r.request_id for r in replies}) == 1
    assert (replies[-1].prompt_tokens, replies[-1].completion_tokens) == (len(prompt_ids), 25)


def test_token_id_prompt_and_sampling(stack, stub):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7, 8, 9]), max_tokens=5, temperature=0.0, top_k=3, seed=5)
    replies = list(stub.Generate(req, timeout=10))
    assert [t for r in replies for t in r.token_ids] == stack.expected([7, 8, 9], 5)
    s = stack.fake.requests[-1].sampling
    assert (s.temperature, s.top_k, s.seed, s.top_p) == (0.0, 3, 5, 1.0)
    list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7]), max_tokens=1), timeout=10))
    assert stack.fake.requests[-1].sampling.temperature == 1.0  # unset: the OpenAI default
    s = stack.fake.requests[-1].sampling
    assert (s.min_p, s.min_tokens, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (0, 0, 1, 0, 0)
    list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7]), max_tokens=4, min_p=0.25, min_tokens=2,
                                          repetition_penalty=1.5, presence_penalty=-0.5, frequency_penalty=0.75),
                       timeout=10))
    s = stack.fake.requests[-1].sampling
    assert (s.min_p, s.min_tokens, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == \
        (0.25, 2, 1.5, -0.5, 0.75)
    assert stack.fake.requests[-1].cache_salt == ""
    list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7]), max_tokens=1, cache_salt="t-1"), timeout=10))
    assert stack.fake.requests[-1].cache_salt == "t-1"  # (vLLM's cache_salt, as over REST)


def test_stop_token_ids_and_what_stopped_the_generation(stack, stub, monkeypatch):
    """As over REST: vLLM's stop_token_ids reach the verifier; the last message says which stop ended it (a stop
    token or string; nothing for the model's EOS), the stop token's text left out unless asked for."""
    import fake_verifier

    whole = stack.expected([7, 8, 9], 12)
    stop_id = whole[4]
    replies = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7, 8, 9]), max_tokens=12,
                                                    stop_token_ids=[stop_id]), timeout=10))
    assert list(stack.fake.requests[-1].sampling.stop_token_ids) == [stop_id]
    assert [t for r in replies for t in r.token_ids] == whole[:5]
    last = replies[-1]
    assert (last.finish_reason, last.WhichOneof("stop_reason"), last.stop_token_id) == ("stop", "stop_token_id", stop_id)
    assert "".join(r.text for r in replies) == stack.tok.decode(whole[:4])
    kept = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7, 8, 9]), max_tokens=12,
                                                 stop_token_ids=[stop_id], include_stop_str_in_output=True), timeout=10))
    assert "".join(r.text for r in kept) == stack.tok.decode(whole[:5])
    text = stack.tok.decode(whole)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    replies = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7, 8, 9]), max_tokens=12, stop=[stop]),
                                 timeout=10))
    assert (replies[-1].WhichOneof("stop_reason"), replies[-1].stop_string) == ("stop_string", stop)
    # the model's EOS: no stop_reason, and its text left out whatever skip_special_tokens says
    eos = fake_verifier.EOS_ID
    monkeypatch.setattr(fake_verifier, "expected_tokens", lambda prompt, n, vocab: (whole[:3] + [eos])[:n])
    for skip in (True, False):
        replies = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7]), max_tokens=6,
                                                        skip_special_tokens=skip), timeout=10))
        assert replies[-1].finish_reason == "stop" and replies[-1].WhichOneof("stop_reason") is None
        assert "".join(r.text for r in replies) == stack.tok.decode(whole[:3])


def test_logprobs_come_with_their_tokens(stack, stub):
    """One TokenLogprob per token id of each message: the verifier's (tests/fake_verifier.fake_logprobs), as over REST;
    none unless asked, and the verifier asked for none."""
    from fake_verifier import fake_logprobs

    replies = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7, 8]), max_tokens=6, logprobs=2),
                                 timeout=10))
    assert stack.fake.requests[-1].sampling.logprobs == 2
    tokens = [t for r in replies for t in r.token_ids]
    assert all(len(r.logprobs) == len(r.token_ids) for r in replies)
    got = [e for r in replies for e in r.logprobs]
    want = [fake_logprobs(t, i, 2, stack.fake.vocab_size) for i, t in enumerate(tokens)]
    assert [e.logprob for e in got] == pytest.approx([w.logprob for w in want])
    assert [list(e.top_token_ids) for e in got] == [list(w.top_token_ids) for w in want]
    assert [list(e.top_logprobs) for e in got] == [pytest.approx(list(w.top_logprobs)) for w in want]
    plain = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7, 8]), max_tokens=3), timeout=10))
    assert not any(r.logprobs for r in plain) and not stack.fake.requests[-1].sampling.HasField("logprobs")


@pytest.mark.parametrize("req,field", [
    (pb.GenerateRequest(max_tokens=3), "prompt"),
    (pb.GenerateRequest(text="", max_tokens=3), "text"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]), max_tokens=3), "token_ids"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999]), max_tokens=3), "token_ids"),
    (pb.GenerateRequest(text="hi"), "max_tokens"),
    (pb.GenerateRequest(text="hi", max_tokens=100000), "max_tokens"),
    (pb.GenerateRequest(text="hi", max_tokens=3, temperature=-1), "temperature"),
    (pb.GenerateRequest(text="hi", max_tokens=3, top_p=0), "top_p"),
    (pb.GenerateRequest(text="hi", max_tokens=3, top_k=-7), "top_k"),
    (pb.GenerateRequest(text="hi", max_tokens=3, stop=[""]), "stop"),
    (pb.GenerateRequest(text="hi", max_tokens=3, min_p=2), "min_p"),
    (pb.GenerateRequest(text="hi", max_tokens=3, min_tokens=4), "min_tokens"),
    (pb.GenerateRequest(text="hi", max_tokens=3, cache_salt="x" * 1025), "cache_salt"),
    (pb.GenerateRequest(text="hi", max_tokens=3, repetition_penalty=0), "repetition_penalty"),
    (pb.GenerateRequest(text="hi", max_tokens=3, frequency_penalty=3), "frequency_penalty"),
    (pb.GenerateRequest(text="hi", max_tokens=3, stop_token_ids=[99999]), "stop_token_ids"),
    (pb.GenerateRequest(text="hi", max_tokens=3, stop_token_ids=[5] * 257), "stop_token_ids"),
    (pb.GenerateRequest(text="hi", max_tokens=3, logprobs=21), "logprobs"),
])
def test_bad_input_is_invalid_argument_naming_the_field(stub, req, field):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field), e.value.details()


def test_top_k_is_refused_in_the_grpc_apis_own_terms(stub):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=3, top_k=-7), timeout=10))
    assert e.value.details() == "top_k: must be -1 (off), 0 (the model's default) or a count to keep, got -7"


def test_unknown_model_is_not_found_and_verifier_refusals_pass_through(stack, stub):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(model="other", text="hi", max_tokens=3), timeout=10))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    stack.fake.fail_with = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=3), timeout=10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in e.value.details()
    assert len(list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=3), timeout=10))) > 0


def _ended_early(stack, stub, timeout: float, end, status: str) -> None:
    """A slow stream of Generate, ``end(call)`` after its first message: the verifier sees the cancel, and the gateway
    counts the request in tandem:requests_total with ``status``."""
    counted = dict(name="tandem:requests_total", api="grpc", status=status)
    before = metric_value(httpx.get(f"{stack.url}/metrics").text, **counted)
    stack.fake.delay_s = 0.05
    try:
        call = stub.Generate(pb.GenerateRequest(text="slow", max_tokens=400), timeout=timeout)
        first = next(call)
        end(call)
        wait_until(lambda: first.request_id in stack.fake.cancelled, what="the verifier to see the cancel")
        wait_until(lambda: metric_value(httpx.get(f"{stack.url}/metrics").text, **counted) == before + 1,
                   what=f"the gateway to count the request as {status}")
    finally:
        stack.fake.delay_s = 0.0


def test_cancel_reaches_the_verifier(stack, stub):
    _ended_early(stack, stub, 10, lambda call: call.cancel(), "CANCELLED")


def test_a_passed_deadline_is_counted_as_such_and_reaches_the_verifier(stack, stub):
    def outlived(call):
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    _ended_early(stack, stub, 0.5, outlived, "DEADLINE_EXCEEDED")


def test_health_mirrors_the_verifier_and_reflection_lists_the_service(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tandem.rpc.generation.v1.Generation"):
        wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
                   == health_pb2.HealthCheckResponse.SERVING, what=f"{service!r} SERVING")
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=5))
    names = {s.name for s in reply.list_services_response.service}
    assert "tandem.rpc.generation.v1.Generation" in names and "grpc.health.v1.Health" in names


def test_malformed_protobuf_is_invalid_argument_without_a_traceback(stack, channel, caplog):
    raw = channel.unary_stream("/tandem.rpc.generation.v1.Generation/Generate",
                               request_serializer=lambda b: b, response_deserializer=lambda b: b)
    counted = dict(name="tandem:requests_total", api="grpc", status="INVALID_ARGUMENT")
    before = metric_value(httpx.get(f"{stack.url}/metrics").text, **counted)
    with pytest.raises(grpc.RpcError) as err:
        list(raw(b"\xff" * 50, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "malformed GenerateRequest" in err.value.details() and "DecodeError" not in err.value.details()
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    # answered, so counted (as a REST body that is not JSON is)
    assert metric_value(httpx.get(f"{stack.url}/metrics").text, **counted) == before + 1


def test_a_stream_whose_client_reads_nothing_ends_and_gives_its_slot_back(stack):
    """gRPC's flow control holds a write while the client reads nothing (a window of 0): 256 such streams held every
    slot for as long as their connections stayed open."""
    import asyncio

    from gateway.grpc_api import GenerationServicer

    class StalledContext:
        code = details = None

        def invocation_metadata(self):
            return ()

        def time_remaining(self):
            return None

        async def write(self, message):  # (the client takes no bytes)
            await asyncio.Event().wait()

        async def abort(self, code, details):  # (grpc.aio's waits for its status, queued behind the unsent message)
            await asyncio.Event().wait()

        def set_code(self, code):
            self.code = code

        def set_details(self, details):
            self.details = details

    servicer, context = GenerationServicer(stack.gateway), StalledContext()
    servicer.send_timeout_s = 0.3
    in_use = stack.gateway.slots.in_use
    stack.run(servicer.Generate(pb.GenerateRequest(text="hello", max_tokens=4), context), timeout=20)
    assert context.code == grpc.StatusCode.CANCELLED and "read nothing" in context.details
    assert stack.gateway.slots.in_use == in_use
