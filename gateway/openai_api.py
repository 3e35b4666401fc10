"""The OpenAI-compatible REST API: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics (and vLLM's /version, /tokenize, /detokenize: tokenize_api; SGLang's /generate: sglang_api). Route functions
stay thin: parse (openai_params), run (rest_flow: admission, choices, streaming), shape (openai_shapes)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.auth import ApiKeyMiddleware
from gateway.errors import INTERNAL_ERROR, UNAVAILABLE, GatewayError
from gateway.metrics import with_prefix
from gateway.request import check_model
from gateway.rest_flow import error_response, generate
from gateway.sglang_api import add_sglang_routes
from gateway.tokenize_api import add_tokenize_routes
from gateway.openai_shapes import ChatShape, CompletionShape

if TYPE_CHECKING:
    from gateway.context import GatewayContext

log = logging.getLogger("gateway.openai")


# FastAPI 0.165 traces every HTTP request itself, on the global tracer provider ours sets: a REST request's own spans
# (gateway.<api> → verifier.generate → drafter.draft) then had a second root beside them, and every /health poll a
# trace of its own. Off where the version has it.
_NO_NATIVE_TELEMETRY = ({"telemetry": {"tracing": False, "operation_spans": False, "metrics": False, "logs": False}}
                        if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def create_app(gw: GatewayContext) -> FastAPI:
    app = FastAPI(title="Tandem gateway", docs_url=None, redoc_url=None, openapi_url=None, **_NO_NATIVE_TELEMETRY)
    if gw.cfg.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, key=gw.cfg.api_key, denied=lambda: gw.metrics.count_request("rest", 401))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # unknown route, wrong method
        response = error_response(GatewayError(exc.status_code, str(exc.detail)))
        response.headers.update(exc.headers or {})  # (a 405's Allow)
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        # The client learns that it failed, never how: exception texts can hold paths and addresses.
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(GatewayError(500, INTERNAL_ERROR))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(gw, request, "completions", CompletionShape)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(gw, request, "chat_completions", ChatShape)

    def model_card(name: str) -> dict:
        card = {"id": name, "object": "model", "created": gw.started_at, "owned_by": "tandem",
                "root": gw.cfg.model_name, "parent": None}  # vLLM puts the model's path here: not ours to show
        if gw.client.known_info is not None:
            card["max_model_len"] = gw.client.known_info.max_context
        return card

    @app.get("/v1/models")
    async def models():
        # every served name, as vLLM lists its --served-model-name's (without one: the folder's name, not its paths)
        names = (gw.cfg.model_name, *gw.cfg.served_model_aliases) if gw.cfg.served_model_name else (gw.cfg.model_name,)
        return {"object": "list", "data": [model_card(name) for name in names]}

    @app.get("/v1/models/{model:path}")  # (the OpenAI client's models.retrieve; a path may hold slashes)
    async def model(model: str):
        if not model:  # (/v1/models/: the list, as /v1/models)
            return await models()
        try:
            check_model(model, gw.cfg.model_names)
        except GatewayError as e:
            return error_response(e)
        return model_card(model if model in gw.cfg.served_model_aliases else gw.cfg.model_name)

    add_tokenize_routes(app, gw)  # /version, /tokenize, /detokenize, at the root as vLLM serves them
    add_sglang_routes(app, gw)  # SGLang's /generate and /get_model_info

    @app.api_route("/health", methods=["GET", "HEAD"])
    # (vLLM's alias, POST too: SageMaker's probe; SGLang's /health_generate generates: not this)
    @app.api_route("/ping", methods=["GET", "HEAD", "POST"])
    async def health():
        # The mirrored state, not a call per probe: an open endpoint must not fan out to the verifier.
        if gw.verifier_ready:
            return Response(status_code=200)
        return error_response(GatewayError(503, UNAVAILABLE))

    @app.get("/metrics")
    async def metrics():
        relayed = []  # (fetched together: a service that hangs costs a scrape its timeout once, not once each)
        for relay, text in zip(gw.metrics_relays, await asyncio.gather(*(r.fetch() for r in gw.metrics_relays))):
            gw.metrics.labels(gw.metrics.relay_up[relay.service]).set(text is not None)
            relayed.append(text or b"")
        return Response(with_prefix(gw.metrics.render() + b"".join(relayed), gw.cfg.metrics_prefix),
                        media_type=gw.metrics.CONTENT_TYPE)

    return app
