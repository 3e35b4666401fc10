"""Faults at the verifier: a duplicate request id is refused without touching the running request; an
engine that fails ends its open streams with an error and the process exits non-zero (to be restarted);
the per-request trace contexts are forgotten on every way a request ends."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from services import Service, free_port, is_serving
from tandem.rpc.verifier.v1 import verifier_pb2 as pb
from tandem.rpc.verifier.v1 import verifier_pb2_grpc as pb_grpc
from tandem.sampling import SamplingParams


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from checkpoints import write_checkpoint

    root = tmp_path_factory.mktemp("faults")
    write_checkpoint(root / "target", "llama", seed=11, num_hidden_layers=2)
    return root / "target"


def request(rid: str, n: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=[5, 6, 7],
                              sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True))


def test_a_duplicate_request_id_is_refused_and_the_running_one_finishes(target_dir, tmp_path):
    verifier = Service("verifier", ["--model", str(target_dir)], free_port(), tmp_path / "verifier.log").start()
    try:
        with grpc.insecure_channel(verifier.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            first = stub.Generate(request("dup", 400), timeout=60)
            tokens = list(next(first).token_ids)  # it is running
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request("dup", 4), timeout=30))
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in e.value.details()
            last = None
            for last in first:  # the first stream goes on to its end (it hung without a finish before)
                tokens += last.token_ids
            assert last.finish_reason == "length" and len(tokens) == 400
            # The id is free again once its request finished.
            assert list(stub.Generate(request("dup", 3), timeout=30))[-1].finish_reason == "length"
    finally:
        verifier.stop()


def test_a_failing_engine_fails_its_streams_and_the_process_exits_non_zero(target_dir, monkeypatch):
    import verifier.__main__ as main_module
    from tandem.engine.llm_engine import LLMEngine

    step, calls = LLMEngine.step, []

    def failing_step(self):
        calls.append(1)
        if len(calls) >= 3:
            raise RuntimeError("device-side assert (injected)")
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", failing_step)
    port, outcome = free_port(), {}

    def client():
        deadline = time.monotonic() + 60
        while not is_serving(port, timeout_s=1.0) and time.monotonic() < deadline:
            time.sleep(0.1)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                outcome["tokens"] = [m for m in pb_grpc.VerifierStub(channel).Generate(request("a", 50), timeout=30)]
            except grpc.RpcError as e:
                outcome["code"], outcome["details"] = e.code(), e.details()

    thread = threading.Thread(target=client)
    thread.start()
    code = main_module.main(["--model", str(target_dir), "--port", str(port)])
    thread.join(30)
    assert code == 3  # non-zero: a supervisor (tandem up, compose) starts a fresh verifier
    # the stream ended with an error, not a hang; a retry's status (the process restarts), not the request's fault
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE, outcome
    assert "device-side" not in outcome["details"]  # the engine's exception stays in the log


# -- the trace map ---------------------------------------------------------------------------------

def traced(rid: str, n: int, sink):
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    from verifier.engine_api import Submission

    span = NonRecordingSpan(SpanContext(trace_id=0xABC, span_id=0xDEF, is_remote=False,
                                        trace_flags=TraceFlags(TraceFlags.SAMPLED)))
    return Submission(rid, [5, 6, 7], SamplingParams(max_new_tokens=n, ignore_eos=True), None, sink,
                      trace_context=trace.set_span_in_context(span))


@pytest.fixture()
def loop_with_client(target_dir):
    """An engine loop whose proposer is a drafter client that never connects (the drafter is lost: no
    request's draft state is ever released through it), serving one request at a time."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.ring import HiddenRing
    from tandem.rpc.drafter.v1 import drafter_pb2
    from verifier.drafter_client import DrafterClient
    from verifier.engine_loop import EngineLoop
    from verifier.metrics import VerifierMetrics

    ring = HiddenRing.create(64, 4, "float32")
    client = DrafterClient("127.0.0.1:1", ring, drafter_pb2.TargetInfo(), deadline_s=1.0)

    def build():
        engine = LLMEngine(EngineConfig(model=str(target_dir), max_running_requests=1))
        engine.proposer = client
        return engine, None, None

    loop = EngineLoop(build, VerifierMetrics(), max_waiting=16, trace_rounds=True)  # (the drafter is sent traces)
    loop.start()
    loop.built.result(60)
    yield loop, client
    loop.stop()
    loop.join(10)
    loop.engine.shutdown()
    ring.close()


def wait_done(outputs: list, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (outputs and getattr(outputs[-1], "finish_reason", None)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert outputs and outputs[-1].finish_reason is not None


def test_trace_contexts_are_forgotten_however_a_request_ends(loop_with_client):
    loop, client = loop_with_client
    long_out, short_out, waiting_out, lost_out = [], [], [], []
    loop.submit(traced("long", 300, long_out.append)).result(10)  # holds the one running slot
    while not long_out:
        time.sleep(0.01)
    assert "long" in client._traces  # the map really holds a running request's context
    loop.submit(traced("waiting", 5, waiting_out.append)).result(10)  # queued behind it
    assert "waiting" in client._traces
    loop.cancel("waiting")  # aborted while waiting
    deadline = time.monotonic() + 10
    while "waiting" in client._traces and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "waiting" not in client._traces and not waiting_out
    loop.cancel("long")
    loop.submit(traced("prefill-only", 1, short_out.append)).result(10)  # finishes at its prefill
    wait_done(short_out)
    loop.submit(traced("ran-without-drafter", 6, lost_out.append)).result(10)  # ran to its end with the drafter lost
    wait_done(lost_out)
    assert len(lost_out[-1].new_token_ids) >= 1
    time.sleep(0.1)
    assert client._traces == {}


def test_the_trace_map_is_bounded():
    from tandem.ring import HiddenRing
    from tandem.rpc.drafter.v1 import drafter_pb2
    from verifier.drafter_client import MAX_TRACES, DrafterClient

    with HiddenRing.create(64, 4, "float32") as ring:
        client = DrafterClient("127.0.0.1:1", ring, drafter_pb2.TargetInfo(), deadline_s=1.0)
        for i in range(MAX_TRACES + 100):
            client.note_trace(f"r{i}", {"traceparent": "x"})
        assert len(client._traces) == MAX_TRACES and f"r{MAX_TRACES + 99}" in client._traces
