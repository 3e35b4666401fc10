"""The public gRPC API (tandem.rpc.generation.v1.Generation) with gRPC health and reflection.

Generate takes text or token ids and streams text and token-id deltas. Bad input is
INVALID_ARGUMENT (NOT_FOUND for an unknown model) with the field named first; verifier refusals
keep their meaning (RESOURCE_EXHAUSTED, UNAVAILABLE...). A client cancel raises CancelledError
in the handler, which cancels the verifier call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway import admission
from gateway.admission import STREAM_SEND_TIMEOUT_S
from gateway.auth import ApiKeyInterceptor
from gateway.errors import INTERNAL_ERROR, SHUTTING_DOWN, GatewayError, bad_request
from gateway.generation import GenerationStream
from gateway.openai_sampling import check_logprobs_count, check_min_tokens, parse_engine_sampling
from gateway.request import (OFFLOAD_PARSE_BYTES, GenerationRequest, check_cache_salt, check_model, check_prompt_ids,
                             check_sampling, check_stop_token_ids, resolve_max_tokens)
from tandem import tracing
from tandem.grpc_decode import MALFORMED, tolerant
from tandem.rpc.generation.v1 import generation_pb2, generation_pb2_grpc
from tandem.service_runtime import GRPC_SERVER_OPTIONS, listen, set_health

if TYPE_CHECKING:
    from gateway.context import GatewayContext

log = logging.getLogger("gateway.grpc")
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class _StalledClient(Exception):
    """The client took none of a message for the send timeout (a flow-control window of 0)."""


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, gw: GatewayContext):
        self._gw = gw
        self.send_timeout_s = STREAM_SEND_TIMEOUT_S

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        """Stream one generation; the last message carries finish_reason and the token counts."""
        if request is MALFORMED:  # (counted as the request it is, as a REST body that is not JSON is)
            self._gw.metrics.count_request("grpc", "INVALID_ARGUMENT")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request: malformed GenerateRequest protobuf")
        gw = self._gw
        arrival = time.monotonic()
        span = tracing.start_span(f"{SERVICE_NAME}/Generate",  # (OpenTelemetry's RPC span name)
                                  parent=tracing.extract_context(context.invocation_metadata()), kind="server",
                                  attributes={"rpc.system": "grpc", "rpc.service": SERVICE_NAME,
                                              "rpc.method": "Generate", "gen_ai.operation.name": "text_completion",
                                              "gen_ai.response.model": gw.cfg.model_name})
        status, error, stream, slot = "OK", None, None, False
        task = asyncio.current_task()
        gw.grpc_streams.add(task)
        try:
            gw.slots.take()
            slot = True
            info = await gw.client.model_info()
            if len(request.text) > OFFLOAD_PARSE_BYTES:  # a long prompt's tokenization stays off the event loop
                generation = await asyncio.to_thread(self._parse, request, info)
            else:
                generation = self._parse(request, info)
            span.set_attributes(generation.span_attributes())
            decode = functools.partial(gw.tokenizer.decode, skip_special_tokens=generation.skip_special_tokens)
            eos = tuple(info.eos_token_ids)  # (an EOS's text is left out as over REST, unless asked for)
            stream = GenerationStream(generation, gw.client, decode, gw.metrics, span, arrival, eos,
                                      request_log=gw.request_log)
            async for d in stream:
                # (written, not yielded: a client that reads nothing — a flow-control window of 0 — is let go)
                message = generation_pb2.GenerateResponse(
                    request_id=generation.request_id, text=d.text, token_ids=d.token_ids,
                    finish_reason=d.finish_reason or "", prompt_tokens=d.prompt_tokens,
                    completion_tokens=d.completion_tokens, cached_tokens=d.cached_tokens)
                for entry in d.logprobs or ():
                    message.logprobs.add(logprob=entry.logprob, top_token_ids=entry.top_token_ids,
                                         top_logprobs=entry.top_logprobs)
                if isinstance(d.stop_reason, str):
                    message.stop_string = d.stop_reason
                elif d.stop_reason is not None:
                    message.stop_token_id = d.stop_reason
                await self._write(context, message)
        except _StalledClient:
            # (not abort: its status would queue behind the message the client does not take, and this handler —
            # its slot, the verifier's request — would wait for it as long as the client holds the connection)
            status, error = "CANCELLED", "the client read nothing for the send timeout"
            context.set_code(grpc.StatusCode.CANCELLED)
            context.set_details(f"the client read nothing of the stream for {self.send_timeout_s:.0f} s")
        except GatewayError as e:
            status, error = e.grpc_code.name, e.message
            await context.abort(e.grpc_code, e.message)
        except grpc.aio.AbortError:
            raise
        except Exception:  # grpc.aio would send the exception's text: the log gets it, the client not
            status, error = "INTERNAL", "internal error"
            log.exception("gRPC Generate failed")
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_ERROR)
        except asyncio.CancelledError:  # (a coroutine now, writing its messages: no GeneratorExit to catch)
            if gw.grpc_cut_short:  # the shutdown's grace is over: our cancel
                task.uncancel()  # (Gateway._drain_grpc), answered with a status clients retry
                status, error = "UNAVAILABLE", SHUTTING_DOWN
                await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
            remaining = context.time_remaining()  # (None: the call had no deadline)
            status = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
            error = "the client's deadline passed" if status == "DEADLINE_EXCEEDED" else "cancelled by the client"
            raise
        finally:
            gw.grpc_streams.discard(task)
            if stream is not None:
                stream.cancel()  # no-op once finished; frees the verifier's request otherwise
            if slot:
                gw.slots.give_back()
            gw.metrics.count_request("grpc", status)
            span.set_attribute("rpc.grpc.status_code", grpc.StatusCode[status].value[0])
            if error is not None:
                tracing.end_rpc_unsuccessful(span, status, error)
            span.end()

    async def _write(self, context: grpc.aio.ServicerContext, message) -> None:
        try:
            async with asyncio.timeout(self.send_timeout_s):
                await context.write(message)
        except TimeoutError:
            raise _StalledClient() from None

    def _parse(self, r: generation_pb2.GenerateRequest, info) -> GenerationRequest:
        gw = self._gw
        check_model(r.model, gw.cfg.model_names)
        which = r.WhichOneof("prompt")
        if which is None:
            raise bad_request("prompt", "set text or token_ids")
        if which == "text":
            if not r.text:
                raise bad_request("text", "the prompt is empty")
            gw.prompt_bound.check(len(r.text), info.max_context, "text")
            ids = gw.tokenizer.encode(r.text, add_special_tokens=True)
        else:
            ids = list(r.token_ids.ids)
        check_prompt_ids(ids, info.vocab_size, which)
        d = gw.sampling_defaults  # the model's generation_config.json, as over REST
        temperature = r.temperature if r.HasField("temperature") else d.temperature
        top_p = r.top_p if r.HasField("top_p") else d.top_p
        if r.top_k < -1:  # (check_sampling's words are REST's, where 0 is "off")
            raise bad_request("top_k", f"must be -1 (off), 0 (the model's default) or a count to keep, got {r.top_k}")
        top_k = 0 if r.top_k == -1 else r.top_k or d.top_k  # proto3's unset is 0; -1 is "off"
        seed = r.seed if r.HasField("seed") else None
        check_sampling(temperature, top_p, top_k, seed, list(r.stop))
        if r.max_tokens == 0:
            # proto3 cannot tell an unset field from 0, so the field is required here.
            raise bad_request("max_tokens", "must be at least 1 (it is required)")
        max_tokens = resolve_max_tokens(r.max_tokens, len(ids), info.max_context, gw.cfg.max_tokens_limit, None,
                                        "max_tokens", which)
        fields = {"min_p": r.min_p if r.HasField("min_p") else None, "min_tokens": r.min_tokens,
                  "repetition_penalty": r.repetition_penalty if r.HasField("repetition_penalty") else None,
                  "presence_penalty": r.presence_penalty, "frequency_penalty": r.frequency_penalty}
        engine = parse_engine_sampling(fields, False, d, False)
        check_min_tokens(engine.min_tokens, max_tokens, "max_tokens")
        check_stop_token_ids(r.stop_token_ids, info.vocab_size)
        skip_special = r.skip_special_tokens if r.HasField("skip_special_tokens") else True
        if r.HasField("logprobs"):
            engine = dataclasses.replace(engine, logprobs=check_logprobs_count(r.logprobs, "logprobs"))
        return GenerationRequest(f"gen-{uuid.uuid4().hex}", tuple(ids), max_tokens, temperature, top_p, top_k, seed,
                                 tuple(r.stop), tuple(r.stop_token_ids), r.ignore_eos, skip_special,
                                 r.include_stop_str_in_output, **dataclasses.asdict(engine),
                                 cache_salt=check_cache_salt(r.cache_salt or None))


class BoundedHealth(health.aio.HealthServicer):
    """gRPC health with at most ``admission.GRPC_HEALTH_WATCHES`` Watch streams at once. Health answers without the API
    key (probes), and a Watch is held open for ever: without a bound, a client without the key filled the port's RPCs
    in progress (``admission.GRPC_EXTRA_RPCS`` past the generations) and every call was refused, Check included."""

    def __init__(self):
        super().__init__()
        self.watching = 0

    async def Watch(self, request, context) -> None:
        if self.watching >= admission.GRPC_HEALTH_WATCHES:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"at most {admission.GRPC_HEALTH_WATCHES} health watches at once; probes can use Check")
        self.watching += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watching -= 1


def build_grpc_server(gw: GatewayContext, address: str) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A server with Generation, health (NOT_SERVING until the verifier is seen serving) and
    reflection (so grpcurl works without the protos). Returns it unstarted, with the bound port."""
    interceptors = ([ApiKeyInterceptor(gw.cfg.api_key, denied=lambda: gw.metrics.count_request("grpc", "UNAUTHENTICATED"))]
                    if gw.cfg.api_key is not None else [])
    server = grpc.aio.server(interceptors=interceptors,
                             options=[*GRPC_SERVER_OPTIONS, ("grpc.max_receive_message_length", gw.cfg.max_body_bytes),
                                      # (a connection left open without calls held a descriptor for ever: enough of
                                      # them and the process could accept nothing, REST included)
                                      ("grpc.max_connection_idle_ms", int(gw.cfg.keep_alive_s * 1000))],
                             maximum_concurrent_rpcs=gw.cfg.max_concurrent_requests + admission.GRPC_EXTRA_RPCS)
    servicer = GenerationServicer(gw)  # (registered by hand: its requests decoded by tandem.grpc_decode)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=tolerant(generation_pb2.GenerateRequest),
            response_serializer=generation_pb2.GenerateResponse.SerializeToString)}),))
    health_servicer = BoundedHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = listen(server, address)
    return server, port, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await set_health(health_servicer, SERVICE_NAME, status)
