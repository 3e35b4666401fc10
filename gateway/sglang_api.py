"""SGLang's native API, for the scripts and benchmarks written against it: ``POST /generate``,
``GET /get_model_info`` and ``GET /health_generate`` (200 once one token was generated now; behind ``--api-key``, unlike
/health: it spends a step of the model).

/generate takes ``text`` or ``input_ids`` (one prompt, or a batch) and ``sampling_params`` in SGLang's names,
which map onto the completion request the OpenAI path parses (so every check and default is that path's; an error
names the SGLang field); ``max_new_tokens`` defaults to SGLang's 128. The answer is SGLang's: per generation
``{"text", "output_ids", "meta_info"}`` — a list for a batch (of one too) or ``n`` > 1 — with ``meta_info`` holding ``id``,
``finish_reason`` (``{"type": "length", "length": N}``, ``{"type": "stop"}``, ``{"type": "abort"}``; null while
running), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` and, once finished, ``e2e_latency`` and, where
the request speculated, ``spec_verify_ct`` (the target forwards that made the tokens: speculative rounds plus plain
decode steps, so that ``completion_tokens / spec_verify_ct`` is tokens per forward as SGLang's tests read it) and
``spec_accept_length`` (tokens per speculative round); with ``return_logprob``, SGLang's log-probability lists
(gateway/sglang_logprobs.py). Streamed, each event holds the text so far (SGLang's default)
and the ``output_ids`` so far (with ``index`` when there are several generations), then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import uuid
from typing import TYPE_CHECKING

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway.body_fields import flag, integer
from gateway.errors import UNAVAILABLE, GatewayError, bad_request
from gateway.openai_params import Limits, OpenAIRequest, parse_completion
from gateway.openai_sampling import check_logprobs_count
from gateway.openai_shapes import CompletionShape
from gateway.request import GenerationRequest
from gateway.rest_flow import error_response, generate
from gateway.sglang_logprobs import LogprobLists, LogprobRequest

if TYPE_CHECKING:
    from gateway.choices import ChoiceResult, Choices
    from gateway.context import GatewayContext
    from gateway.generation import Delta

SGLANG_MAX_NEW_TOKENS = 128  # SGLang's default
HEALTH_GENERATE_TIMEOUT_S = 20.0  # /health_generate: a token not back by then is unhealthy
# sampling_params' SGLang names → the completion request's (the same meaning)
SAMPLING_NAMES = {
    "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "temperature": "temperature", "top_p": "top_p",
    "top_k": "top_k", "min_p": "min_p", "stop": "stop", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "include_stop_str_in_output", "n": "n",
    "sampling_seed": "seed", "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "regex": "regex", "json_schema": "json_schema", "ebnf": "ebnf",
}
# sampling_params SGLang takes that change nothing here at their default
NO_OP_SAMPLING = {"spaces_between_special_tokens": True, "logit_bias": None, "custom_params": None}
# /generate's fields SGLang's clients send (its bench_serving: lora_path, logprob_start_len...), taken at the values
# that ask for nothing here, refused at any other; other fields are ignored, as vLLM ignores what it does not know
NO_OP_REQUEST = {"return_hidden_states": lambda v: not v,
                 "lora_path": lambda v: not v, "image_data": lambda v: v is None, "input_embeds": lambda v: v is None,
                 "token_ids_logprob": lambda v: v is None}


def add_sglang_routes(app: FastAPI, gw: GatewayContext) -> None:
    @app.post("/generate")
    async def sglang_generate(request: Request):
        return await generate(gw, request, "generate", GenerateShape, parse=_parser(gw))

    @app.get("/get_model_info")
    async def model_info():
        # (SGLang's keys; the model's path is not the client's to see: its served name stands for it)
        return {"model_path": gw.cfg.model_name, "tokenizer_path": gw.cfg.model_name, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
                "has_audio_understanding": False}

    @app.get("/health_generate")
    async def health_generate():
        if gw.verifier_ready and await _one_token(gw):
            return Response(status_code=200)
        return error_response(GatewayError(503, UNAVAILABLE))


async def _one_token(gw: GatewayContext) -> bool:
    """Whether the verifier generates a token now (greedy, after token 0) within HEALTH_GENERATE_TIMEOUT_S."""
    request = GenerationRequest(f"health-{uuid.uuid4().hex}", (0,), max_tokens=1, temperature=0.0, ignore_eos=True)
    call = gw.client.generate(request.to_proto(), metadata=[])
    try:
        async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
            while (msg := await call.read()) is not grpc.aio.EOF:
                if msg.token_ids:
                    return True
    except (grpc.aio.AioRpcError, TimeoutError):
        pass
    finally:
        call.cancel()
    return False


def _parser(gw: GatewayContext):
    def parse(body: dict, request_id: str, limits: Limits) -> OpenAIRequest:
        try:
            # (SGLang's default max_new_tokens: a default, shortened to the room left, never refused as if asked for)
            sglang_limits = dataclasses.replace(limits, default_max_tokens=SGLANG_MAX_NEW_TOKENS)
            parsed = parse_completion(completion_body(body), request_id, gw.tokenizer, sglang_limits)
        except GatewayError as e:  # named as the client named it
            raise _renamed(e, "text" if body.get("text") is not None else "input_ids") from None
        asked = logprob_requests(body, len(parsed.prompts))
        parts = []
        for part, mine in zip(parsed.prompts, asked):
            length = len(part.generation.prompt_ids)
            if mine is not None and mine.start is not None and mine.start >= length:  # (SGLang refuses it too)
                raise bad_request("logprob_start_len", f"must be less than the prompt's length ({length} tokens), "
                                                       f"got {mine.start}")
            if part.generation.prompt_logprobs is not None:
                # the verifier scores the prompt from there on (none of it for a prompt that asked for none, in a
                # batch whose others did): the prefix cache may hold the context before it
                start = length if mine is None or mine.start is None else max(1, mine.start + 1)
                part = dataclasses.replace(part, generation=dataclasses.replace(part.generation,
                                                                                 prompt_logprobs_from=start))
            parts.append(part)
        parsed = dataclasses.replace(parts[0], more=tuple(parts[1:]))
        return dataclasses.replace(parsed, answer_ids=answer_ids(body.get("rid"), parsed),
                                   sglang_logprobs=asked if any(asked) else None)

    return parse


def completion_body(body: dict) -> dict:
    """An SGLang /generate body as the completion request that means the same."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("text", "give one of text and input_ids")
    if text is not None and not (isinstance(text, str) or (isinstance(text, list) and text
                                                            and all(isinstance(t, str) for t in text))):
        raise bad_request("text", "must be a string or a list of strings (a batch)")
    if ids is not None and not (_token_ids(ids) or (isinstance(ids, list) and ids and all(_token_ids(i) for i in ids))):
        raise bad_request("input_ids", "must be a list of token ids or a list of those (a batch)")
    if not isinstance(body.get("stream", False), bool):
        raise bad_request("stream", "must be a boolean")
    if not isinstance(body.get("stream_options") or {}, dict):  # (every chunk's meta_info holds the usage anyway)
        raise bad_request("stream_options", "must be an object")
    for name, is_no_op in NO_OP_REQUEST.items():
        if not is_no_op(body.get(name)):
            raise bad_request(name, "is not supported by this server")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise bad_request("sampling_params", "must be an object")
    unknown = sorted(set(sampling) - set(SAMPLING_NAMES) - set(NO_OP_SAMPLING))
    if unknown:
        raise bad_request(f"sampling_params.{unknown[0]}", "is not a sampling parameter this server takes")
    for name, default in NO_OP_SAMPLING.items():
        if sampling.get(name, default) not in (default, None):
            raise bad_request(f"sampling_params.{name}", "is not supported by this server")
    completion = {ours: sampling[theirs] for theirs, ours in SAMPLING_NAMES.items() if sampling.get(theirs) is not None}
    batch = text if isinstance(text, list) else ids if ids is not None and isinstance(ids[0], list) else None
    prompts = 1 if batch is None else len(batch)
    asked = [a for a in logprob_requests(body, prompts) if a is not None]
    if asked:  # the completion path's logprobs: N (the most any prompt asks); its echo gives the prompt's (no text here)
        completion["logprobs"] = max(a.top for a in asked)
        completion["echo"] = any(a.needs_prompt_logprobs for a in asked)
    if completion.get("max_tokens") == 0:  # (SGLang's prompt alone: the completion path's log-likelihood request, no text)
        if completion.get("min_tokens"):  # (checked here: that request asks the verifier for one token)
            raise bad_request("sampling_params.min_new_tokens", "must be at most max_new_tokens (0)")
        completion["echo"] = True
    return {**completion, "prompt": text if text is not None else ids, "stream": body.get("stream", False)}


def logprob_requests(body: dict, prompts: int) -> tuple[LogprobRequest | None, ...]:
    """``return_logprob``'s settings for each of the batch's ``prompts``, each checked (None: not asked for). As SGLang
    takes them, ``return_logprob``, ``top_logprobs_num`` and ``logprob_start_len`` are each one value for all or a
    list of one per prompt."""
    def each(name: str, default) -> list:
        value = body.get(name)
        if not isinstance(value, list):
            return [{name: value}] * prompts
        if len(value) != prompts:
            raise bad_request(name, f"has {len(value)} values for {prompts} prompts")
        return [{name: v} for v in value]

    with_text = flag(body, "return_text_in_logprobs", False)  # (read always: SGLang's clients send it)
    asked = []
    for on, top, start in zip(each("return_logprob", False), each("top_logprobs_num", 0),
                              each("logprob_start_len", -1)):
        if not flag(on, "return_logprob", False):
            asked.append(None)
            continue
        top = check_logprobs_count(integer(top, "top_logprobs_num", 0), "top_logprobs_num")
        start = integer(start, "logprob_start_len", -1)
        if start < -1:
            raise bad_request("logprob_start_len", f"must be -1 (the prompt's last token) or a prompt position, "
                                                   f"got {start}")
        asked.append(LogprobRequest(top, None if start == -1 else start, with_text))
    return tuple(asked)


def answer_ids(rid, parsed: OpenAIRequest) -> tuple[str, ...]:
    """The ids ``rid`` gives the answers to ``parsed`` (none: the server's), as SGLang numbers them: one answer takes
    the string itself; several (a batch, n) take it with _0, _1, ... after it, or a list of as many strings."""
    if rid is None:
        return ()
    count = parsed.options.n * len(parsed.prompts)
    if isinstance(rid, str):
        return (rid,) if count == 1 and not parsed.batched else tuple(f"{rid}_{i}" for i in range(count))
    if not (isinstance(rid, list) and all(isinstance(r, str) for r in rid)):
        raise bad_request("rid", "must be a string or a list of strings")
    if len(rid) != count:
        raise bad_request("rid", f"has {len(rid)} ids for {count} answers (the batch's prompts times n)")
    return tuple(rid)


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _renamed(e: GatewayError, prompt_name: str) -> GatewayError:
    """``e`` naming the SGLang field that the completion field it names came from (``prompt_name``: text or
    input_ids)."""
    theirs = {ours: f"sampling_params.{name}" for name, ours in SAMPLING_NAMES.items()} | {"prompt": prompt_name}
    if e.param not in theirs:
        return e
    name = theirs[e.param]
    message = e.message[len(e.param):] if e.message.startswith(e.param) else f": {e.message}"
    short = name.rpartition(".")[2]  # (the body names the field too: "lower max_tokens to ...")
    message = re.sub(rf"\b{re.escape(e.param)}\b", short, message)
    return GatewayError(e.status, name + message, param=name)


class GenerateShape(CompletionShape):
    """SGLang's answer to /generate (see the module), from the generations of the choices it follows."""

    id_prefix = "gen"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.include_usage = False  # (the counts are in each meta_info)
        self.started = time.monotonic()
        self.streams: list = []
        self._ids: tuple[str, ...] = ()  # meta_info.id of each answer
        self.listed = False  # answered as a list: a batch (of one too) or n > 1
        # per generation: its text and ids so far (each streamed event carries them all, as SGLang's default streaming)
        self._texts = [""] * self.n
        self._output_ids: list[list[int]] = [[] for _ in range(self.n)]
        self._asked: tuple[LogprobRequest | None, ...] = ()  # return_logprob's settings, per prompt (follow)
        self._per_prompt = 1  # generations per prompt (n)
        self._lists: list[LogprobLists | None] = []  # per generation, with return_logprob: its lists so far

    def follow(self, choices: Choices, request: OpenAIRequest) -> None:
        self.streams, self.listed = choices.streams, self.n > 1 or request.batched
        self._ids = request.answer_ids or tuple(stream.request.request_id for stream in self.streams)
        self._asked, self._per_prompt = request.sglang_logprobs or (), request.options.n
        if self._asked:
            self._lists = [self._new_lists(i) for i in range(self.n)]

    def opening(self, firsts: list[Delta] = ()) -> list[dict]:
        return []

    def chunk(self, delta: Delta, index: int = 0) -> dict | None:
        self._texts[index] += delta.text
        self._output_ids[index] += delta.token_ids
        out = {"text": self._texts[index], "output_ids": list(self._output_ids[index]),
               "meta_info": self._meta(index, delta.finish_reason, delta.prompt_tokens, delta.completion_tokens,
                                       delta.cached_tokens, _matched(delta.stop_reason, delta.stop_token))}
        if self._lists and (lists := self._lists[index]) is not None:
            lists.add(delta.token_ids, delta.logprobs or [])
            if delta.prompt_logprobs is not None:
                lists.set_prompt(delta.prompt_logprobs)
            out["meta_info"].update(lists.meta())
        return {**out, "index": index} if self.listed else out

    def response(self, results: list[ChoiceResult], usage: dict) -> dict | list:
        outs = []
        for i, r in enumerate(results):
            counts = self.streams[i].usage
            meta = self._meta(i, r.finish_reason, counts["prompt_tokens"], counts["completion_tokens"],
                              counts["prompt_tokens_details"]["cached_tokens"], _matched(r.stop_reason, r.stop_token))
            if self._asked and (lists := self._new_lists(i)) is not None:
                lists.add(r.token_ids, r.logprobs or [])
                if r.prompt_logprobs is not None:
                    lists.set_prompt(r.prompt_logprobs)
                meta.update(lists.meta())
            outs.append({"text": r.text, "output_ids": r.token_ids, "meta_info": meta})
        return outs if self.listed else outs[0]

    def _new_lists(self, index: int) -> LogprobLists | None:
        asked = self._asked[index // self._per_prompt]  # (a prompt's generations follow each other)
        return None if asked is None else LogprobLists(asked, self.logprobs.token_text, self.logprobs.prompt_ids[index])

    def _meta(self, index: int, finish: str | None, prompt: int, completion: int, cached: int,
              matched: str | int | None) -> dict:
        stream = self.streams[index]
        meta = {"id": self._ids[index], "finish_reason": _finish_reason(finish, completion, matched),
                "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached}
        if finish is not None:
            meta["e2e_latency"] = time.monotonic() - self.started
            spec = stream.spec_stats
            if spec is not None and spec.rounds:  # (a request that never speculated reports none, as SGLang without)
                round_tokens = round(spec.rounds * spec.accept_length_mean)
                # (the first token is the prefill's; the others came from rounds or plain decode steps)
                meta["spec_verify_ct"] = spec.rounds + max(0, completion - 1 - round_tokens)
                meta["spec_accept_length"] = spec.accept_length_mean
        return meta


def _matched(stop_reason: str | int | None, stop_token: int | None) -> str | int | None:
    """SGLang's ``matched``: the stop string, else the token that stopped it (EOS too, where vLLM says none)."""
    return stop_reason if isinstance(stop_reason, str) else stop_token


def _finish_reason(finish: str | None, completion: int, matched: str | int | None) -> dict | None:
    if finish is None:
        return None
    if finish == "length":
        return {"type": "length", "length": completion}
    return {"type": finish} if matched is None else {"type": finish, "matched": matched}
