"""The API key (``--api-key`` / ``TANDEM_API_KEY``), as vLLM checks it: ``Authorization: Bearer KEY``
on the REST API's ``/v1/*``, ``/tokenize``, ``/detokenize`` and ``/version`` (401 with an OpenAI error
body) and ``authorization`` metadata on the public gRPC API (UNAUTHENTICATED). ``/health``,
``/metrics`` and gRPC health stay open: probes and scrapers carry no key. Keys are compared in constant time."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

import grpc

from gateway.errors import GatewayError

_SCHEME = b"bearer"
_OPEN_GRPC_PREFIX = "/grpc.health.v1.Health/"
_DENIED = "a valid API key is required: send 'Authorization: Bearer <key>'"
# vLLM's tokenizer endpoints and SGLang's native API live at the root but serve the model as /v1 does: the same key.
_GUARDED_ROOT = frozenset({"/tokenize", "/detokenize", "/version", "/generate", "/get_model_info", "/health_generate"})


def _guarded(path: str) -> bool:
    return path.startswith("/v1") or path.rstrip("/") in _GUARDED_ROOT


def bearer_matches(header: bytes | str | None, key: bytes) -> bool:
    """Whether an Authorization value is ``Bearer <key>`` (scheme case-insensitive, per RFC 7235)."""
    if header is None:
        return False
    if isinstance(header, str):
        header = header.encode("latin-1", "replace")
    scheme, _, token = header.strip().partition(b" ")
    # compare_digest takes time independent of where the tokens differ; it runs even for a wrong
    # scheme so the answer's timing says nothing about which part was wrong.
    return hmac.compare_digest(token.strip(), key) & (scheme.lower() == _SCHEME)


class ApiKeyMiddleware:
    """ASGI middleware: 401 for the guarded paths without the key; everything else passes through. ``denied()`` is
    called for each refusal (the gateway counts them: a broken key rotation shows on its metrics)."""

    def __init__(self, app, key: str, denied: Callable[[], None] = lambda: None):
        self.app = app
        self._key = key.encode()
        self._denied = denied

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _guarded(scope["path"]) and scope["method"] != "OPTIONS":
            header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if not bearer_matches(header, self._key):
                self._denied()
                await _send_401(send)
                return
        await self.app(scope, receive, send)


async def _send_401(send) -> None:
    body = json.dumps(GatewayError(401, _DENIED).body(), separators=(",", ":")).encode()  # (as JSONResponse renders)
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every gRPC method but health's, unless the metadata carries the key; ``denied()`` called
    for each refusal."""

    def __init__(self, key: str, denied: Callable[[], None] = lambda: None):
        self._key = key.encode()
        self._denied = denied

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_GRPC_PREFIX):
            return handler
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if bearer_matches(header, self._key):
            return handler
        self._denied()
        return _denying(handler)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only refuses (grpc.aio runs a plain coroutine
    for any of the four shapes)."""

    async def deny(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(handler.request_streaming, handler.response_streaming)](
        deny, response_serializer=handler.response_serializer)  # (the body is never decoded: refused as bytes)
