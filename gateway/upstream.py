"""The gateway's side of the verifier contract (tandem.rpc.verifier.v1): one channel, the generations over one
GenerateMany stream (gateway/upstream_many.py) or a Generate stream each, model info fetched once, health as the
verifier reports it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import UNAVAILABLE, GatewayError, from_upstream
from gateway.upstream_many import ManyStream
from tandem import internal_secret
from tandem.rpc.verifier.v1 import verifier_pb2, verifier_pb2_grpc

log = logging.getLogger("gateway.upstream")

MAX_UPSTREAM_MESSAGE_BYTES = 256 << 20  # the largest message taken from the verifier (see below)
# Keepalive lets a dead or stopped verifier surface as UNAVAILABLE on streams that are waiting on it (within ~25 s),
# instead of hanging until TCP notices — or forever, where the host still answers TCP for a stopped process. The
# verifier allows pings every 10 s (verifier/serve.py: min_recv_ping_interval_without_data_ms): 15 s stays above it.
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 15_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),  # (any ping's ack: without it a stopped verifier's streams waited 60 s)
    # a long prompt's log-probabilities come in one message (~150 bytes a token at top-20: a 128k-token prompt
    # ~20 MB, which 16 MB refused as RESOURCE_EXHAUSTED, a 429 the client retried for ever); the verifier is trusted
    ("grpc.max_receive_message_length", MAX_UPSTREAM_MESSAGE_BYTES),
    ("grpc.max_send_message_length", 16 << 20),
    # gRPC's reconnect backoff grows to 2 minutes by default: a verifier back after a restart went
    # unnoticed for ~50 s. Loopback or LAN: retry every second at most, and give a connect 2 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.min_reconnect_backoff_ms", 2_000),
]


REFUSE_AFTER_FAILED_CHECKS = 2  # health checks in a row that did not find the verifier SERVING before generations


class VerifierClient:
    def __init__(self, address: str, timeout_s: float, secret: str | None = None,
                 message_interval_us: Callable[[], int] = lambda: 0, *, one_stream: bool):
        """``secret``: the internal plane's (tandem.internal_secret), presented on every call a verifier that has one
        requires it of; ``message_interval_us()``: what each generation asks of its stream's pace (gateway/pacing.py);
        ``one_stream``: the generations over one GenerateMany stream where the verifier serves it
        (GatewayConfig.upstream_streams)."""
        self.address = address
        self._message_interval_us = message_interval_us
        self._timeout = timeout_s
        self._auth = list(internal_secret.metadata(secret))
        self._refused = False  # the verifier refused our credentials (logged once)
        self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = verifier_pb2_grpc.VerifierStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._one_stream = one_stream
        self._many = ManyStream(lambda commands: self._stub.GenerateMany(commands, metadata=self._auth),
                                message_interval_us)
        self._info: verifier_pb2.ModelInfo | None = None
        self._info_lock = asyncio.Lock()
        # A generation found the verifier unreachable since the last health check that reached it: GET /health says
        # so at once rather than at the next check (up to health_poll_s later, while requests already got 503).
        self.unreachable = False
        self.serving = False  # SERVING at the health mirror's last check (gateway.server._mirror_health)
        self.failed_checks = 0  # the mirror's checks in a row that did not find it SERVING

    async def model_info(self) -> verifier_pb2.ModelInfo:
        """The verifier's ModelInfo (context length, vocab, EOS ids), fetched on first need and kept:
        it cannot change without the verifier restarting on another model, which is a redeploy."""
        if self._info is not None:
            return self._info
        async with self._info_lock:
            if self._info is None:
                try:
                    self._info = await self._stub.GetModelInfo(verifier_pb2.ModelInfoRequest(), timeout=self._timeout,
                                                               metadata=self._auth)
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                        if not self._refused:
                            log.error("verifier %s refused this gateway: give the gateway the verifier's internal secret "
                                      "($%s or --internal-secret-file)", self.address, internal_secret.ENV)
                        self._refused = True
                        raise GatewayError(503, UNAVAILABLE) from e
                    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        log.warning("verifier %s not reachable: %s", self.address, e.code().name)
                        raise GatewayError(503, UNAVAILABLE) from e
                    raise from_upstream(e, self.address) from e
                log.info("verifier %s serves %s (context %d, vocab %d, speculative %s)", self.address,
                         self._info.model or "?", self._info.max_context, self._info.vocab_size, self._info.speculative)
        return self._info

    @property
    def known_info(self) -> verifier_pb2.ModelInfo | None:
        """ModelInfo if it has been fetched already (never waits on the verifier)."""
        return self._info

    async def healthy(self) -> bool:
        """SERVING in the verifier's gRPC health; a verifier without a health service counts as
        healthy when it answers GetModelInfo."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self._timeout)
            self.unreachable = False
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                return False
        try:
            await self._stub.GetModelInfo(verifier_pb2.ModelInfoRequest(), timeout=self._timeout, metadata=self._auth)
            self.unreachable = False
            return True
        except grpc.aio.AioRpcError:
            return False

    @property
    def ready(self) -> bool:
        """SERVING at the last health check, and no generation has found it unavailable since."""
        return self.serving and not self.unreachable

    def generate(self, request: verifier_pb2.GenerateRequest, metadata: list[tuple[str, str]]):
        """Start one generation; the caller reads it with ``await call.read()`` and must
        ``call.cancel()`` when it stops reading early, so the verifier frees the request. Refused at once (503,
        which clients retry) while the last health check did not find the verifier SERVING: a stopped, hung or
        restarting verifier would leave it waiting with no deadline while GET /health already says 503. Two checks in
        a row, so that one slow answer from a busy verifier does not turn its traffic away. (One generation's
        UNAVAILABLE does not refuse the others: a dead verifier refuses their calls at once itself.)"""
        if self.failed_checks >= REFUSE_AFTER_FAILED_CHECKS:
            raise GatewayError(503, UNAVAILABLE)
        request.message_interval_us = self._message_interval_us()
        if self._one_stream and self._info is not None and self._info.generate_many:
            return self._many.start(request, metadata)
        return self._stub.Generate(request, metadata=[*metadata, *self._auth])

    async def close(self) -> None:
        await self._many.close()
        await self._channel.close()
