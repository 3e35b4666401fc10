"""vLLM's tokenizer endpoints at the root: ``GET /version``, ``POST /tokenize`` (a prompt, or chat
messages rendered by the model's template) and ``POST /detokenize``. Tokenizing follows the
completion and chat paths (add_special_tokens: true for a prompt, false for rendered messages, which
hold their own BOS); detokenizing keeps special tokens, as transformers' decode does."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import tandem
from gateway.admission import read_body
from gateway.body_fields import flag
from gateway.chat_request import render_chat
from gateway.errors import GatewayError, bad_request
from gateway.openai_params import _add_special_tokens, _messages, parse_json
from gateway.request import OFFLOAD_PARSE_BYTES, check_model, check_prompt_ids

if TYPE_CHECKING:
    from gateway.context import GatewayContext


def add_tokenize_routes(app: FastAPI, gw: GatewayContext) -> None:
    @app.get("/version")
    async def version():
        return {"version": tandem.__version__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _answer(gw, request, _tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _answer(gw, request, _detokenize)


async def _answer(gw: GatewayContext, request: Request, work) -> JSONResponse:
    try:
        raw = await read_body(request, gw.cfg.max_body_bytes, gw.cfg.body_timeout_s, gw.body_budget)
        body = parse_json(raw)
        check_model(body.get("model"), gw.cfg.model_names)
        info = await gw.client.model_info()  # the context length and vocabulary the verifier serves
        # Megabytes of text take a while to tokenize: off the event loop, as the generation paths do.
        if len(raw) <= OFFLOAD_PARSE_BYTES:
            return JSONResponse(work(gw, body, info))
        # (and its answer's encoding: megabytes of token ids and strings held the loop, /health waited seconds)
        return await asyncio.to_thread(lambda: JSONResponse(work(gw, body, info)))
    except GatewayError as e:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


def _tokenize(gw: GatewayContext, body: dict, info) -> dict:
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("prompt", "send either prompt or messages")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("prompt", "must be a string")
        gw.prompt_bound.check(len(prompt), info.max_context, "prompt")
        ids = gw.tokenizer.encode(prompt, add_special_tokens=_add_special_tokens(body, True))
    else:
        if gw.chat_template is None:
            raise bad_request("messages", "this model has no chat template (tokenizer_config.json has none)")
        text = render_chat(gw.chat_template, body, _messages(body["messages"]),
                           reads_tool_calls=gw.answer_formats.tools is not None)
        gw.prompt_bound.check(len(text), info.max_context, "messages")
        ids = gw.tokenizer.encode(text, add_special_tokens=_add_special_tokens(body, False))
    # No token-count check: /tokenize is how a client learns that a prompt is too long. A text that cannot fit by its
    # characters alone is refused as the generation routes refuse it (megabytes tokenized held the event loop seconds)
    strs = [gw.tokenizer.token_str(i) for i in ids] if flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": info.max_context, "tokens": ids, "token_strs": strs}


def _detokenize(gw: GatewayContext, body: dict, info) -> dict:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("tokens", f"must be a list of token ids, got {json.dumps(tokens)[:40]}")
    if tokens:
        check_prompt_ids(tokens, info.vocab_size, "tokens")
    return {"prompt": gw.tokenizer.decode(tokens, skip_special_tokens=False)}
