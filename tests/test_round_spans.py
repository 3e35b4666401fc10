"""Per-round trace spans (verifier/round_spans.py): a speculative round writes its four phases under the request's
span with its accept length; a plain step writes none."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry import trace

from tandem.engine.step import StepInfo, StepOutput
from verifier.round_spans import RoundSpans

PHASES = {"draft": (0, 10), "verify": (10, 30), "accept": (30, 35), "draft_extend": (35, 40)}


def test_speculative_rounds_write_their_phases_and_plain_steps_none():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = RoundSpans()
    spans.tracer = provider.get_tracer("test")
    request = spans.tracer.start_span("verifier.generate")
    parent = trace.set_span_in_context(request)
    info = StepInfo(0, 2, dict(PHASES))
    spans.record(parent, info, StepOutput("a", [7], None))  # a plain step
    assert exporter.get_finished_spans() == ()
    spans.record(parent, info, StepOutput("a", [7, 8, 9], None, drafted=3, round_accepts=[2]))
    written = exporter.get_finished_spans()
    assert [s.name for s in written] == list(PHASES)
    assert all(s.parent.span_id == request.get_span_context().span_id for s in written)
    assert written[1].attributes["tandem.accept_length"] == 3 and written[1].attributes["tandem.rounds"] == 1
    assert [(s.start_time, s.end_time) for s in written] == list(PHASES.values())
