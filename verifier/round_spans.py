"""Per-round trace spans: ``draft``, ``verify``, ``accept``, ``draft_extend`` under each request's span.

A round serves a whole batch, so its phases are timed once (StepInfo) and written as child spans of
every request in the batch that has a trace and speculated in it, with that request's accept length and token
counts. A plain step writes none: the request's own span covers it, and four spans a plain token (most steps of a
batch the policy keeps plain) were most of a trace's volume and said nothing.
Spans are created after the fact with the recorded start/end times, so tracing adds nothing to the
round itself; with tracing off (no SDK, or no provider configured) this is a no-op.
"""

from __future__ import annotations

from typing import Any

from tandem.engine.step import StepInfo, StepOutput

try:
    from opentelemetry import trace
except ImportError:  # the GPU machine may not have opentelemetry
    trace = None


class RoundSpans:
    def __init__(self) -> None:
        self.tracer = trace.get_tracer("tandem.verifier") if trace is not None else None

    def record(self, parent: Any, info: StepInfo, out: StepOutput) -> None:
        if self.tracer is None or parent is None or not out.round_accepts:
            return
        attrs = {
            "tandem.request_id": out.rid,
            "tandem.batch.prefill": info.num_prefill,
            "tandem.batch.decode": info.num_decode,
            "tandem.tokens.new": len(out.new_token_ids),
            "tandem.draft_tokens": out.drafted,
            "tandem.accepted_tokens": out.accepted,
            # per round: a step may hold a run of rounds queued on the device (--spec-rounds)
            "tandem.accept_length": ((out.accepted + len(out.round_accepts)) / len(out.round_accepts)
                                     if out.round_accepts else len(out.new_token_ids)),
            "tandem.rounds": len(out.round_accepts),
        }
        for phase in ("draft", "verify", "accept", "draft_extend"):
            if phase not in info.spans:
                continue
            start, end = info.spans[phase]
            span = self.tracer.start_span(phase, context=parent, start_time=start, attributes=attrs)
            span.end(end_time=end)
