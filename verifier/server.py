"""The verifier's gRPC surface: Generate (one server stream per request) and GetModelInfo.

The servicer only converts protobuf ↔ engine types, validates, and relays the engine loop's outputs;
everything else happens on the engine loop's thread. Requests are deserialised by hand so that a
malformed message is an INVALID_ARGUMENT the client can read, not an opaque INTERNAL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid

import grpc

from tandem import internal_secret, tracing
from tandem.engine.step import StepOutput
from tandem.errors import ConfigError, DuplicateRequestError, OutOfPagesError, TandemError
from tandem.grpc_decode import MALFORMED, tolerant
from tandem.log_limit import LimitedLog
from tandem.configs.model import ModelConfig
from tandem.rpc.verifier.v1 import verifier_pb2 as pb
from tandem.sampling import SamplingParams
from tandem.speculative.spec_config import SpecConfig
from verifier.config import IN_PROCESS, IN_PROCESS_MAX_TOPK, VerifierConfig
from verifier.engine_api import EngineStopped, QueueFull, QueueSink, Submission
from verifier.engine_loop import EngineLoop

log = logging.getLogger("verifier.server")
_refusals = LimitedLog(log)
SERVICE = "tandem.rpc.verifier.v1.Verifier"


class VerifierService:
    def __init__(self, cfg: VerifierConfig, model_cfg: ModelConfig, speculative: bool):
        """Registered before the server starts; answers UNAVAILABLE until ``attach`` gives it the loop."""
        self.cfg, self.model_cfg, self.speculative = cfg, model_cfg, speculative
        self.context = cfg.engine.served_context(model_cfg.max_position_embeddings)  # --context-length, checked
        self.default_spec = SpecConfig(cfg.num_steps, cfg.topk, cfg.num_draft_tokens) if speculative else None
        self.loop: EngineLoop | None = None
        self.draining = False  # set once the server stops taking calls (drain)
        self.on_drain: set = set()  # callables: what an open GenerateMany stream does when the server drains

    def attach(self, loop: EngineLoop) -> None:
        self.loop = loop

    def drain(self) -> None:
        """The server stops taking calls: open GenerateMany streams refuse new starts and end once theirs finish (a
        stream held open by an idle gateway would otherwise keep the server's grace period for itself)."""
        self.draining = True
        for wake in list(self.on_drain):
            wake()

    def handler(self, **more: grpc.RpcMethodHandler) -> grpc.GenericRpcHandler:
        """Generate and GetModelInfo, and ``more`` methods by name (GenerateMany: verifier/generate_many.py)."""
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, request_deserializer=tolerant(pb.GenerateRequest),
                response_serializer=pb.GenerateResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.model_info, request_deserializer=tolerant(pb.ModelInfoRequest),
                response_serializer=pb.ModelInfo.SerializeToString),
            **more,
        })

    async def authenticate(self, context: grpc.aio.ServicerContext) -> None:
        """Only callers with the internal secret (its gateway; tandem.internal_secret), where one is set: the
        gateway's API key, limits and request log must not be a port away from anyone who can reach this one."""
        if not internal_secret.matches(self.cfg.internal_secret, context.invocation_metadata()):
            internal_secret.log_refused(_refusals, context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this verifier serves its gateway only "
                                f"(the internal secret: ${internal_secret.ENV} or --internal-secret-file)")

    async def model_info(self, request, context) -> pb.ModelInfo:
        await self.authenticate(context)
        return pb.ModelInfo(model=self.cfg.model_name,
                            vocab_size=self.model_cfg.vocab_size, max_context=self.context,
                            eos_token_ids=list(self.model_cfg.eos_token_ids), speculative=self.speculative,
                            generate_many=True)

    async def generate(self, request, context: grpc.aio.ServicerContext):
        await self.authenticate(context)
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is still loading its model")
        if request is MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request: malformed GenerateRequest protobuf")
        try:
            params, spec = self.convert(request)
        except ConfigError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        outputs: asyncio.Queue = asyncio.Queue()
        aio_loop = asyncio.get_running_loop()
        span = self.request_span(rid, request, tracing.extract_context(context.invocation_metadata()))
        sub, finished, produced = None, False, 0
        try:
            try:
                sub = self.submission(rid, request, params, spec, QueueSink(aio_loop, outputs), span)
            except Exception as e:  # (gRPC answers UNKNOWN; the span, ended below, says why)
                tracing.set_error(span, repr(e))
                raise
            try:
                await asyncio.wrap_future(self.loop.submit(sub))
            except REFUSALS as e:
                await self._refuse(context, span, refusal_code(e), e)
            pace, sent_at = request.message_interval_us / 1e6, None
            while not finished:
                out = await outputs.get()
                # the gateway asked for a pace (its loop falls behind): what comes until the interval is over goes too
                out = (await _paced(out, outputs, sent_at + pace) if pace and sent_at is not None
                       else _coalesced(out, outputs))
                if isinstance(out, BaseException):  # the engine loop died (logged there); the process restarts:
                    # UNAVAILABLE, a retry's status (the gateway's 503), not a fault of the request
                    tracing.set_error(span, "the engine failed")
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier's engine failed; it restarts")
                produced += len(out.new_token_ids)
                finished = out.finish_reason is not None
                response = self.response(rid, request, out, produced)
                if finished:  # (ended before the last message goes: the caller's span, ended on it, stays the parent
                    end_request_span(span, produced)  # that outlasts this one)
                yield response
                sent_at = aio_loop.time()
        finally:
            end_request_span(span, produced)
            if not finished and sub is not None:  # client went away or cancelled: free the request's KV next
                self.loop.cancel(rid, sub)  # round (only this submission's: a refused duplicate leaves the running one)

    @staticmethod
    def submission(rid: str, request, params: SamplingParams, spec, sink, span) -> Submission:
        return Submission(rid, list(request.prompt_token_ids), params, spec, sink=sink,
                          trace_context=tracing.context_with(span), cache_salt=request.cache_salt)

    @staticmethod
    def request_span(rid: str, request, parent):
        return tracing.start_span("verifier.generate", parent=parent, kind="server",
                                  attributes={"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": "Generate",
                                              "tandem.request_id": rid,
                                              "tandem.prompt_tokens": len(request.prompt_token_ids)},
                                  tracer="tandem.verifier")

    @staticmethod
    async def _refuse(context: grpc.aio.ServicerContext, span, code: grpc.StatusCode, error: Exception) -> None:
        """Abort with ``code``; the span in error only where the server failed (OpenTelemetry's RPC conventions)."""
        tracing.end_rpc_unsuccessful(span, code.name, str(error))
        await context.abort(code, str(error))

    def response(self, rid: str, request, out: StepOutput, produced: int) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=rid, token_ids=out.new_token_ids, prompt_tokens=len(request.prompt_token_ids),
                                   completion_tokens=produced, cached_tokens=out.cached_tokens,
                                   finish_reason=out.finish_reason.value if out.finish_reason else "")
        for entries, field in ((out.logprobs, resp.logprobs), (out.prompt_logprobs, resp.prompt_logprobs)):
            if entries is not None:
                field.extend(pb.TokenLogprobs(logprob=e.logprob, top_token_ids=[t for t, _ in e.top],
                                              top_logprobs=[v for _, v in e.top], rank=e.rank or 0)
                             for e in entries)
        stats = out.spec_stats
        if stats is not None:
            resp.spec.CopyFrom(pb.SpecStats(rounds=stats.rounds, accept_length_mean=stats.accept_length_mean,
                                                acceptance_by_position=stats.acceptance_by_position))
        return resp

    def convert(self, request) -> tuple[SamplingParams, object]:
        s = request.sampling
        context = self.context
        if not request.prompt_token_ids:
            raise ConfigError("prompt_token_ids: the prompt is empty")
        if request.message_interval_us > MAX_MESSAGE_INTERVAL_US:
            raise ConfigError(f"message_interval_us must be at most {MAX_MESSAGE_INTERVAL_US}, "
                              f"got {request.message_interval_us}")
        if s.max_new_tokens <= 0:
            raise ConfigError("sampling.max_new_tokens must be > 0")
        if s.max_new_tokens > context:
            raise ConfigError(f"sampling.max_new_tokens {s.max_new_tokens} exceeds the served context ({context})")
        if s.temperature < 0:
            raise ConfigError(f"sampling.temperature must be >= 0, got {s.temperature:g}")
        if not 0.0 <= s.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {s.top_p:g}")
        params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0,
                                seed=s.seed if s.HasField("seed") else None, max_new_tokens=s.max_new_tokens,
                                ignore_eos=s.ignore_eos, stop_token_ids=tuple(s.stop_token_ids), min_p=s.min_p,
                                min_tokens=s.min_tokens, repetition_penalty=s.repetition_penalty or 1.0,
                                presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                                logprobs=s.logprobs if s.HasField("logprobs") else None,
                                prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
                                prompt_logprobs_from=s.prompt_logprobs_from or 1)
        if params.prompt_logprobs_from > len(request.prompt_token_ids):
            raise ConfigError(f"sampling.prompt_logprobs_from {params.prompt_logprobs_from} is past the prompt "
                              f"({len(request.prompt_token_ids)} tokens)")
        try:
            params.validate()
        except ConfigError as e:
            raise ConfigError(f"sampling.{e}") from None
        sp = request.speculation
        if not self.speculative or sp.disable:
            return params, None
        if not (sp.num_steps or sp.topk or sp.num_draft_tokens):
            return params, "default"
        d = self.default_spec
        spec = SpecConfig(sp.num_steps or d.num_steps, sp.topk or d.topk, sp.num_draft_tokens or d.num_draft_tokens)
        most = max(IN_PROCESS_MAX_TOPK, d.topk)
        if self.cfg.drafter == IN_PROCESS and spec.topk > most:  # (a drafter service refuses it in its round)
            raise ConfigError(f"speculation.topk {spec.topk} exceeds the in-process head's {most}")
        return params, spec


REFUSALS = (TandemError, EngineStopped)  # how the engine loop refuses a submission


def refusal_code(error: Exception) -> grpc.StatusCode:
    """The status a submission the engine loop refused (with one of REFUSALS) ends with."""
    if isinstance(error, DuplicateRequestError):  # the running request with this id goes on untouched
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(error, QueueFull):  # retry later
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, OutOfPagesError):  # larger than the whole KV cache: retrying can never help
        return grpc.StatusCode.OUT_OF_RANGE
    if isinstance(error, EngineStopped):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INVALID_ARGUMENT


# The most tokens one coalesced message carries: with top-20 log-probabilities a token is ~150 bytes, and the
# gateway takes messages of at most 256 MiB (gateway/upstream.py).
MAX_COALESCED_TOKENS = 1024
def end_request_span(span, produced: int) -> None:
    """End the request's span once (a second end would be the SDK's warning)."""
    if span.is_recording():
        span.set_attribute("tandem.completion_tokens", produced)
        span.end()


MAX_MESSAGE_INTERVAL_US = 1_000_000  # GenerateRequest.message_interval_us: a stream waits at most this long


def is_final(out) -> bool:
    """The engine loop's last word on a request: its finishing output, or the error that ended the loop."""
    return isinstance(out, BaseException) or out.finish_reason is not None


def _coalesced(out, outputs: asyncio.Queue):
    """``out`` and the outputs queued behind it, as one message: when this loop falls behind the engine's steps, the
    tokens waiting go together instead of one message a step — the same text, fewer messages to carry (a round's
    tokens already go together). A slow reader alone does not make them wait here: gRPC's flow control takes thousands
    of small messages before a write blocks (a paced stream waits on purpose: ``_paced``)."""
    while not is_final(out) and not outputs.empty() and len(out.new_token_ids) < MAX_COALESCED_TOKENS:
        out = merged_outputs(out, outputs.get_nowait())
    return out


async def _paced(out, outputs: asyncio.Queue, until: float):
    """``out`` and the outputs that come until ``until`` (the event loop's time), as one message — sent at once when
    the request's last output comes (a paced stream's end never waits)."""
    try:
        async with asyncio.timeout_at(until):  # (one deadline: not a task per output, and a cancel is never lost)
            while not is_final(out) and len(out.new_token_ids) < MAX_COALESCED_TOKENS:
                out = merged_outputs(out, await outputs.get())
    except TimeoutError:  # (an output the deadline interrupted stays queued: a Queue.get cancelled takes nothing)
        pass
    return _coalesced(out, outputs)


def merged_outputs(out: StepOutput, more):
    """Two outputs of a request as one (or the engine loop's error, which ends the stream)."""
    if isinstance(more, BaseException):
        return more
    return dataclasses.replace(
        out, new_token_ids=out.new_token_ids + more.new_token_ids, finish_reason=more.finish_reason,
        drafted=out.drafted + more.drafted, spec_stats=more.spec_stats,
        round_accepts=out.round_accepts + more.round_accepts,
        logprobs=None if out.logprobs is None and more.logprobs is None
        else (out.logprobs or []) + (more.logprobs or []),
        prompt_logprobs=out.prompt_logprobs or more.prompt_logprobs,
        cached_tokens=out.cached_tokens or more.cached_tokens)
