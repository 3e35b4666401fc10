"""Traces: the gateway's span per request and the verifier's span join one trace through the W3C
context in the gRPC metadata; tandem.tracing's propagation helpers round-trip."""

from __future__ import annotations

import logging
import time

import grpc
import httpx
import pytest
from gateway_harness import MODEL_NAME, Stack, metric_value, stack_fixture, wait_until
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem import tracing
from tandem.rpc.generation.v1 import generation_pb2, generation_pb2_grpc


@pytest.fixture(scope="module")
def exporter():
    exp = InMemorySpanExporter()
    assert tracing.setup_tracing("tandem-test", exporter=exp) is not None
    return exp


stack = stack_fixture(after=("exporter",))
GRPC_SPAN = "tandem.rpc.generation.v1.Generation/Generate"
CALL_SPAN = "tandem.rpc.verifier.v1.Verifier/Generate"  # the gateway's client span of its call to the verifier


def _spans(exporter, *names):
    wait_until(lambda: all(any(s.name == n for s in exporter.get_finished_spans()) for n in names),
               what=f"spans {names}")
    return {n: [s for s in exporter.get_finished_spans() if s.name == n][-1] for n in names}


def test_rest_request_and_verifier_share_one_trace(stack, exporter):
    exporter.clear()
    r = httpx.post(f"{stack.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200
    spans = _spans(exporter, "gateway.completions", CALL_SPAN, "verifier.generate")
    gw, call, vf = spans["gateway.completions"], spans[CALL_SPAN], spans["verifier.generate"]
    assert gw.context.trace_id == call.context.trace_id == vf.context.trace_id
    # OpenTelemetry's RPC modelling: the gateway's server span, its client span of the call, the verifier's server span
    assert call.kind.name == "CLIENT" and call.parent.span_id == gw.context.span_id
    assert (call.attributes["rpc.system"], call.attributes["rpc.method"]) == ("grpc", "Generate")
    assert call.status.status_code.name == "UNSET"
    assert vf.parent is not None and vf.parent.span_id == call.context.span_id
    assert gw.kind.name == "SERVER" and gw.attributes["http.response.status_code"] == 200
    assert gw.attributes["gen_ai.usage.output_tokens"] == 4 and gw.attributes["gen_ai.operation.name"] == "text_completion"
    assert stack.fake.metadata[-1]["traceparent"].split("-")[1] == format(gw.context.trace_id, "032x")


def test_a_rest_request_is_one_trace_and_health_probes_are_none(stack, exporter):
    """Every span a REST request makes is in the gateway span's trace (FastAPI 0.165's own HTTP spans, on the same
    provider, were a second root), and a health probe makes no span at all."""
    exporter.clear()
    for _ in range(3):
        assert httpx.get(f"{stack.url}/health").status_code == 200
    r = httpx.post(f"{stack.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200
    gw = _spans(exporter, "gateway.completions", "verifier.generate")["gateway.completions"]
    spans = exporter.get_finished_spans()
    assert gw.parent is None
    assert {s.context.trace_id for s in spans} == {gw.context.trace_id}, [(s.name, s.parent) for s in spans]


def test_a_client_that_leaves_a_whole_answer_ends_its_span_once_with_usage(stack, exporter, caplog):
    """A non-streamed request whose client gives up: its generation is cancelled before the span ends, so what it
    made is on the span and nothing writes on an ended span (the SDK's warning for normal client behaviour)."""
    exporter.clear()
    stack.fake.delay_s = 0.05
    try:
        with caplog.at_level(logging.WARNING, logger="opentelemetry"):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{stack.url}/v1/completions", timeout=2.0,
                           json={"model": MODEL_NAME, "prompt": "slow", "max_tokens": 400})
            gw = _spans(exporter, "gateway.completions")["gateway.completions"]
            time.sleep(0.2)
    finally:
        stack.fake.delay_s = 0.0
    assert gw.attributes["http.response.status_code"] == 499 and "gen_ai.usage.output_tokens" in gw.attributes
    # a client that left is no server fault (OpenTelemetry's HTTP conventions): status unset, the reason beside it
    assert gw.status.status_code.name == "UNSET" and gw.attributes["tandem.refused"] == "client disconnected"
    assert "ended span" not in caplog.text


def test_a_stream_its_client_leaves_says_the_200_it_sent_and_why_it_ended(stack, exporter):
    """The span's http.response.status_code is the status line sent (OpenTelemetry's HTTP conventions): a stream's 200,
    its client's leaving in tandem.refused; the metrics count the outcome, 499."""
    exporter.clear()
    counted = dict(name="tandem:requests_total", api="completions", status="499")
    before = metric_value(httpx.get(f"{stack.url}/metrics").text, **counted)
    stack.fake.delay_s = 0.05
    try:
        body = {"model": MODEL_NAME, "prompt": "slow", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first event, then the client leaves
        gw = _spans(exporter, "gateway.completions")["gateway.completions"]
    finally:
        stack.fake.delay_s = 0.0
    assert gw.attributes["http.response.status_code"] == 200
    assert gw.attributes["tandem.refused"] == "client disconnected" and gw.status.status_code.name == "UNSET"
    wait_until(lambda: metric_value(httpx.get(f"{stack.url}/metrics").text, **counted) == before + 1,
               what="the request counted as 499")


def test_incoming_traceparent_is_the_parent_and_streams_end_their_span(stack, exporter):
    exporter.clear()
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body,
                      headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}) as r:
        r.read()
    spans = _spans(exporter, "gateway.chat_completions", "verifier.generate")
    gw = spans["gateway.chat_completions"]
    assert format(gw.context.trace_id, "032x") == trace_id and format(gw.parent.span_id, "016x") == parent_id
    assert spans["verifier.generate"].context.trace_id == gw.context.trace_id


def test_grpc_request_is_traced_and_errors_are_marked(stack, exporter):
    exporter.clear()
    with grpc.insecure_channel(stack.grpc_target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        list(stub.Generate(generation_pb2.GenerateRequest(text="hi", max_tokens=3), timeout=10))
        spans = _spans(exporter, GRPC_SPAN, "verifier.generate")
        assert spans[GRPC_SPAN].context.trace_id == spans["verifier.generate"].context.trace_id
        exporter.clear()
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(generation_pb2.GenerateRequest(text="hi", max_tokens=0), timeout=10))
        span = _spans(exporter, GRPC_SPAN)[GRPC_SPAN]
        # a bad request is no server fault (OpenTelemetry's RPC conventions): status unset, the code an integer
        assert span.status.status_code.name == "UNSET" and span.attributes["rpc.grpc.status_code"] == 3
        assert span.attributes["tandem.refused"].startswith("max_tokens")
        exporter.clear()
        stack.fake.fail_with = (grpc.StatusCode.INTERNAL, "boom")
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(generation_pb2.GenerateRequest(text="hi", max_tokens=3), timeout=10))
    spans = _spans(exporter, GRPC_SPAN, CALL_SPAN)
    span = spans[GRPC_SPAN]
    assert span.status.status_code.name == "ERROR" and span.attributes["rpc.grpc.status_code"] == 13
    assert spans[CALL_SPAN].status.status_code.name == "ERROR" and "INTERNAL" in spans[CALL_SPAN].status.description


def test_n_choices_sum_their_usage_on_the_span(stack, exporter):
    exporter.clear()
    r = httpx.post(f"{stack.url}/v1/completions", json={"model": MODEL_NAME, "prompt": ["hi", "hello there"],
                                                         "n": 2, "temperature": 1, "max_tokens": 5})
    usage = r.json()["usage"]
    gw = _spans(exporter, "gateway.completions")["gateway.completions"]
    assert (gw.attributes["gen_ai.usage.input_tokens"], gw.attributes["gen_ai.usage.output_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"])
    assert len(gw.attributes["gen_ai.response.finish_reasons"]) == 4


def test_propagation_helpers_round_trip(exporter):
    span = tracing.start_span("outer", kind="client")
    ctx = tracing.context_with(span)
    md = tracing.inject_metadata(ctx)
    assert [k for k, _ in md] == ["traceparent"]
    assert md[0][1].split("-")[1] == tracing.trace_id_hex(span)
    for carrier in (md, dict(md), tracing.inject_dict(ctx)):
        child = tracing.start_span("inner", parent=tracing.extract_context(carrier))
        assert child.get_span_context().trace_id == span.get_span_context().trace_id
        child.end()
    with tracing.use_span(span):
        assert tracing.inject_dict() == dict(md)  # the current span is the default
    span.end()
    assert tracing.inject_metadata() == []  # no current span: nothing to send
    assert tracing.extract_context(None) is None and tracing.extract({}) is None


def test_the_request_log_line_names_the_trace(exporter, caplog):
    s = Stack(log_requests=True)
    try:
        exporter.clear()
        with caplog.at_level(logging.INFO, logger="gateway.requests"):
            assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
            gw = _spans(exporter, "gateway.completions")["gateway.completions"]
            wait_until(lambda: any(r.name == "gateway.requests" for r in caplog.records), what="the log line")
        [line] = [r.getMessage() for r in caplog.records if r.name == "gateway.requests"]
        assert line.endswith(f", trace {gw.context.trace_id:032x}"), line
    finally:
        s.close()
