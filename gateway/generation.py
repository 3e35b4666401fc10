"""One request's verifier stream, turned into text deltas: the part both front ends share.

It reads the verifier's messages, detokenizes incrementally, cuts at stop strings (and then cancels
the verifier call: nothing after a stop string is wanted), records the latency and token metrics,
and makes sure the verifier call is cancelled whenever the reader stops early — a client that went
away, a front end that failed — so the verifier frees the request's batch slot and KV pages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from gateway.detokenize import IncrementalDetokenizer, StopStrings
from gateway.errors import GatewayError, from_upstream
from gateway.metrics import GatewayMetrics
from gateway.request import GenerationRequest
from gateway.request_log import RequestLog
from gateway.upstream import VerifierClient
from tandem import tracing
from tandem.rpc.verifier.v1 import verifier_pb2

VERIFIER_SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
VERIFIER_GENERATE = f"{VERIFIER_SERVICE}/Generate"  # (OpenTelemetry's RPC span name)


@dataclass
class Delta:
    text: str  # new text since the previous delta
    token_ids: list[int]  # new tokens since the previous delta
    finish_reason: str | None  # "stop" | "length" | "abort" on the last delta, else None
    prompt_tokens: int
    completion_tokens: int  # total so far
    # The verifier's TokenLogprobs, one per entry of token_ids, when the request asked for them (tokens past a
    # stop string are dropped with theirs).
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # on the first delta, when asked: one per prompt token after the first
    cached_tokens: int = 0  # of prompt_tokens, those the verifier found in its prefix cache
    # vLLM's stop_reason, on a last delta whose finish_reason is "stop": the stop string matched, or the stop token id
    # (of the request's stop_token_ids) that ended it; None for an EOS
    stop_reason: str | int | None = None
    stop_token: int | None = None  # ... and the token that ended it there, EOS included (SGLang's matched)


class SpanUsage:
    """A request's usage on its span, summed over its generations (``n`` choices, a batch of prompts: each prompt
    counted once, as the response's usage counts it); written whole after each generation ends."""

    def __init__(self, span):
        self.span = span
        self.input_tokens = self.output_tokens = 0
        self.finish_reasons: list[str] = []

    def add(self, prompt_tokens: int, completion_tokens: int, reason: str) -> None:
        self.input_tokens += prompt_tokens
        self.output_tokens += completion_tokens
        self.finish_reasons.append(reason)
        self.span.set_attributes({"gen_ai.usage.input_tokens": self.input_tokens,
                                  "gen_ai.usage.output_tokens": self.output_tokens,
                                  "gen_ai.response.finish_reasons": self.finish_reasons})


class GenerationStream:
    """Async iterator of Delta. The last one has ``finish_reason`` set; an upstream failure is
    raised as GatewayError. Call ``cancel()`` when abandoning it before the end."""

    def __init__(self, request: GenerationRequest, client: VerifierClient, decode: Callable[[list[int]], str],
                 metrics: GatewayMetrics, span, arrival: float, eos_token_ids: Sequence[int] = (),
                 request_log: RequestLog | None = None, span_usage: SpanUsage | None = None,
                 counts_prompt: bool = True):
        """``span_usage``: the request's, shared by its generations (default: this one's alone); ``counts_prompt``:
        this generation's prompt is counted there (the first choice of its prompt)."""
        self.request = request
        self._decode, self._log, self._text = decode, request_log, []  # the text only for a log that keeps it
        self._first_token_at: float | None = None
        self._client = client
        self._metrics = metrics
        self._span = span
        self._span_usage, self._counts_prompt = span_usage or SpanUsage(span), counts_prompt
        self._arrival = arrival
        self._detok = IncrementalDetokenizer(decode)
        self._stops = StopStrings(request.stop, request.include_stop_str_in_output)
        # A generation the verifier ends with "stop" ends on an EOS or stop token: its text is left
        # out unless include_stop_str_in_output (vLLM's rule), also when special tokens are kept.
        self._stop_ids = frozenset(eos_token_ids) | frozenset(request.stop_token_ids)
        self._last_token: int | None = None
        self._prompt_tokens = len(request.prompt_ids)
        self._completion_tokens = 0
        self._cached_tokens = 0
        self._prompt_logprobs_sent = False
        self._last_token_at: float | None = None
        self.finish_reason: str | None = None
        self.spec_stats = None  # the verifier's SpecStats from its final message, when it sends one
        # The call's client span (OpenTelemetry's RPC conventions: a server span's parent is its caller's client span)
        # rides in the metadata as W3C context, so the verifier's spans join the gateway's trace under it.
        self._rpc_span = tracing.start_span(VERIFIER_GENERATE, parent=tracing.context_with(span), kind="client",
                                            attributes={"rpc.system": "grpc", "rpc.service": VERIFIER_SERVICE,
                                                        "rpc.method": "Generate", "server.address": client.address})
        try:
            self._call = client.generate(request.to_proto(),
                                         tracing.inject_metadata(tracing.context_with(self._rpc_span)))
        except BaseException as e:  # (refused before any call: a verifier the health checks found down)
            tracing.set_error(self._rpc_span, str(e))
            self._rpc_span.end()
            raise
        metrics.labels(metrics.running).inc()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        while True:
            try:
                msg = await self._call.read()
            except grpc.aio.AioRpcError as e:
                error = from_upstream(e, self._client.address)
                self._finish("error", cause=f"verifier {e.code().name}: {(e.details() or '')[:200]}")
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self._client.unreachable = True
                raise error from e
            except asyncio.CancelledError:
                self.cancel()
                raise
            if msg is grpc.aio.EOF:
                # The verifier must end with a finish_reason; if it closed without one, say what
                # the numbers suggest rather than leave the client without a reason.
                reason = "length" if self._completion_tokens >= self.request.max_tokens else "stop"
                return self._delta([], reason)
            if msg.prompt_tokens:
                self._prompt_tokens = msg.prompt_tokens
            if msg.cached_tokens:
                self._cached_tokens = msg.cached_tokens
            if msg.HasField("spec"):
                self.spec_stats = msg.spec
            if self.request.prompt_only:  # the first message holds the prompt's log-probabilities: that is the answer
                self._call.cancel()
                return self._delta([], "length", [], list(msg.prompt_logprobs))
            new = list(msg.token_ids)
            if new:
                self._record_timing(len(new))
            if new or msg.finish_reason:
                return self._delta(new, msg.finish_reason or None, list(msg.logprobs), list(msg.prompt_logprobs))

    def _delta(self, new: list[int], reason: str | None, logprobs: list | None = None,
               prompt_logprobs: list | None = None) -> Delta:
        if self.request.logprobs is None:
            logprobs = None
        elif len(logprobs or ()) != len(new):
            raise GatewayError(502, "the verifier sent no log-probabilities for some tokens")
        final = reason is not None
        if new:
            self._last_token = new[-1]
        hide_last = (reason == "stop" and bool(new) and new[-1] in self._stop_ids
                     and not self.request.include_stop_str_in_output)
        text, kept = self._text_of(new, final, hide_last)
        if kept < len(new):  # a stop string ended at token kept - 1: the tokens after it were not wanted
            new, logprobs = new[:kept], (logprobs[:kept] if logprobs is not None else None)
        self._completion_tokens += len(new)
        if self._stops.hit:
            reason = "stop"
            self._call.cancel()  # the rest of the generation is not wanted
        if self._log is not None and self._log.keeps_text:
            self._text.append(text)
        if reason is not None:
            self._finish(reason)
        if self.request.prompt_logprobs is None or self._prompt_logprobs_sent:
            prompt_logprobs = None
        else:  # one per prompt token after the first, as every shape reads them: None before the first asked
            got, whole = list(prompt_logprobs or ()), len(self.request.prompt_ids) - 1
            skipped = self.request.prompt_logprobs_from - 1
            if len(got) == whole - skipped:
                prompt_logprobs = [None] * skipped + got
            elif len(got) != whole:  # (whole: a verifier that scores every prompt token, as before field 15)
                raise GatewayError(502, "the verifier sent no log-probabilities for the prompt")
        self._prompt_logprobs_sent = self._prompt_logprobs_sent or prompt_logprobs is not None
        return Delta(text, new, reason, self._prompt_tokens, self._completion_tokens, logprobs, prompt_logprobs,
                     cached_tokens=self._cached_tokens, stop_reason=self._stop_reason(reason),
                     stop_token=self._last_token if reason == "stop" and self._last_token in self._stop_ids else None)

    def _stop_reason(self, reason: str | None) -> str | int | None:
        if reason != "stop":
            return None
        if self._stops.matched is not None:
            return self._stops.matched
        return self._last_token if self._last_token in self.request.stop_token_ids else None

    def _text_of(self, new: list[int], final: bool, hide_last: bool) -> tuple[str, int]:
        """The text a message's tokens add, and how many of them count: all, or up to the one that completes a
        stop string. As vLLM, stop strings are not looked for in the first min_tokens tokens. A message may
        carry many tokens (a round's, or those a slow client let queue: verifier/server.py), so with stop
        strings the tokens past min_tokens go one at a time, and the answer is the same however they came."""
        shown = new[:-1] if hide_last else new
        if not self._stops.active:
            return self._detok.add(shown, final=final), len(new)
        head = max(0, min(len(shown), self.request.min_tokens - self._completion_tokens))
        pieces = [self._detok.add(shown[:head], final=final and head == len(shown))] if head else []
        for i in range(head, len(shown)):
            last = final and i == len(shown) - 1
            pieces.append(self._stops.feed(self._detok.add(shown[i : i + 1], final=last), final=last))
            if self._stops.hit:
                return "".join(pieces), i + 1
        if final and head == len(shown):  # nothing fed with final above: flush what waits
            tail = self._detok.add([], final=True)
            past_min = self._completion_tokens + len(new) > self.request.min_tokens
            pieces.append(self._stops.feed(tail, final=True) if past_min else tail)
        return "".join(pieces), len(new)

    def _record_timing(self, n: int) -> None:
        now = time.monotonic()
        m = self._metrics
        if self._last_token_at is None:
            self._first_token_at = now
            m.labels(m.ttft).observe(now - self._arrival)
            self._span.add_event("first_token")
        else:
            m.itl.observe((now - self._last_token_at) / n, n)
        self._last_token_at = now

    def cancel(self) -> None:
        """Stop the verifier's work on this request (idempotent; a no-op once finished)."""
        if self.finish_reason is None:
            self._call.cancel()
            self._finish("abort")

    def _finish(self, reason: str, cause: str = "") -> None:
        """``cause``: what failed, for an "error" (the request log's line says it)."""
        self.finish_reason = reason
        if reason == "error":  # (a client span is in error on any unsuccessful status; a cancel is the caller's)
            tracing.set_error(self._rpc_span, cause)
        self._rpc_span.end()
        m = self._metrics
        m.labels(m.running).dec()
        m.labels(m.prompt_tokens).inc(self._prompt_tokens)
        m.labels(m.generation_tokens).inc(self._completion_tokens)
        if reason != "error":
            m.labels(m.request_success, finished_reason=reason).inc()
            now = time.monotonic()
            m.labels(m.e2e).observe(now - self._arrival)
            if self._first_token_at is not None:
                m.labels(m.decode_time).observe(now - self._first_token_at)
            m.labels(m.request_prompt_tokens).observe(self._prompt_tokens)
            m.labels(m.request_generation_tokens).observe(self._completion_tokens)
        self._span_usage.add(self._prompt_tokens if self._counts_prompt else 0, self._completion_tokens, reason)
        spec = self.spec_stats if self.spec_stats is not None and self.spec_stats.rounds else None
        if spec is not None:
            self._span.set_attributes({"tandem.spec.rounds": spec.rounds,
                                       "tandem.spec.accept_length_mean": spec.accept_length_mean})
        if self._log is not None:
            ttft = None if self._first_token_at is None else self._first_token_at - self._arrival
            prompt = self._decode(list(self.request.prompt_ids)) if self._log.keeps_text else ""
            self._log.finished(self.request, reason, self._prompt_tokens, self._completion_tokens, ttft,
                               time.monotonic() - self._arrival, spec.accept_length_mean if spec else None,
                               prompt, "".join(self._text), tracing.trace_id_hex(self._span), cause)

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self._prompt_tokens, "completion_tokens": self._completion_tokens,
                "total_tokens": self._prompt_tokens + self._completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self._cached_tokens}}
