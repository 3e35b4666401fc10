"""OpenAI request bodies → GenerationRequest, refusing what we cannot honour with a 400 that names
the field. Unknown fields are ignored (clients send many); known fields we do not implement are
refused unless they hold their no-op value, so nobody silently gets something other than asked.
Extensions as in vLLM (sent through ``extra_body``): ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``min_p``, ``min_tokens``, ``repetition_penalty`` (gateway/openai_sampling.py), ``add_special_tokens`` (default: true for prompt text, false for a rendered chat template, which holds its own
BOS). Unset sampling fields take the model's generation_config.json defaults (gateway/generation_defaults.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.body_fields import flag, integer, number
from gateway.chat_answer import AnswerFormats
from gateway.chat_request import render_chat, tool_calls_asked
from gateway.errors import GatewayError, bad_request
from gateway.generation_defaults import SamplingDefaults
from gateway.openai_extras import ENGINE_FIELDS, OutputOptions, parse_output_options
from gateway.openai_sampling import check_min_tokens, parse_engine_sampling
from gateway.prompt_bound import PromptBound
from gateway.read_body import ReadBody, with_field
from gateway.request import (GenerationRequest, check_cache_salt, check_model, check_prompt_ids, check_sampling,
                             check_stop_token_ids, resolve_max_tokens)
from tandem.chat_template import ChatTemplate
from tandem.rpc.verifier.v1 import verifier_pb2
from tandem.tokenizer import Tokenizer

# Fields of the OpenAI API we do not implement: allowed only with their no-op value.
_NO_OP = {
    "best_of": lambda v: v is None or (v == 1 and not isinstance(v, bool)),
    "suffix": lambda v: v is None or v == "",
    "logit_bias": lambda v: not v,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    **ENGINE_FIELDS,
}


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class Limits:
    """What bounds a request: the verifier's model and this server's settings."""
    model_names: tuple[str, ...]  # what a request's model may say (GatewayConfig.model_names)
    info: verifier_pb2.ModelInfo
    max_tokens_limit: int | None
    default_max_tokens: int
    prompt_bound: PromptBound
    defaults: SamplingDefaults = SamplingDefaults()  # the model's generation_config.json


@dataclass(frozen=True)
class OpenAIRequest:
    generation: GenerationRequest
    stream: bool
    include_usage: bool
    options: OutputOptions = OutputOptions()  # n, echo, special tokens, stop strings in the text
    echo_text: str = ""  # the prompt's text, put before each choice's when options.echo
    # A completion's batch of prompts: the ones after the first, each parsed as a request of its own (its choices
    # follow the first's, n each, in order)
    more: tuple["OpenAIRequest", ...] = ()
    batched: bool = False  # the prompt came as a list of prompts (a batch, of one too)
    answer_ids: tuple[str, ...] = ()  # ids the client chose for its answers, in order (SGLang's rid): shown for ours
    sglang_logprobs: Any = None  # SGLang's return_logprob settings (gateway/sglang_logprobs.LogprobRequest); None: off
    answers: AnswerFormats = AnswerFormats()  # what a chat answer's text is read into (reasoning, tool calls)

    @property
    def prompts(self) -> tuple["OpenAIRequest", ...]:
        return (self, *self.more)


def parse_json(raw: bytes) -> ReadBody:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # ValueError: also an integer of over 4300 digits
        raise GatewayError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    except RecursionError:
        raise GatewayError(400, "the request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise GatewayError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    _check_strings(raw, body)
    return ReadBody(body)


def _check_strings(raw: bytes, body: dict) -> None:
    """JSON's \\uD800 escapes decode to lone surrogates, which no tokenizer, protobuf or response
    encoder accepts: refuse them, naming the top-level field. Raw UTF-8 cannot hold a surrogate, so
    bodies without such an escape skip the walk (iterative: any depth)."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    for top, value in body.items():
        _utf8(top, "body")
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, str):
                _utf8(v, top)
            elif isinstance(v, dict):
                stack.extend(x for kv in v.items() for x in kv)
            elif isinstance(v, list):
                stack.extend(x for x in v if isinstance(x, (str, list, dict)))


def _utf8(s: str, field: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(field, "contains a lone UTF-16 surrogate "
                          "(an unpaired \\uD800-\\uDFFF escape), which is not text") from None


MAX_PROMPTS = 64  # a completion's batch of prompts: each a generation (times n) on the verifier


def parse_completion(body: dict, request_id: str, tok: Tokenizer, limits: Limits) -> OpenAIRequest:
    """A completion: one prompt, or a batch of them (vLLM and the OpenAI API take a list: evaluation harnesses send
    one), each parsed as a request of its own."""
    prompt = body.get("prompt")
    batched = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    if not batched or len(prompt) == 1:
        parsed = _parse_prompt(body, request_id, tok, limits)
        return dataclasses.replace(parsed, batched=True) if batched else parsed
    if len(prompt) > MAX_PROMPTS:
        raise bad_request("prompt", f"a batch holds at most {MAX_PROMPTS} prompts, got {len(prompt)}")
    if len(prompt) * (integer(body, "n") or 1) > MAX_PROMPTS:
        raise bad_request("n", f"a batch's prompts times n must be at most {MAX_PROMPTS}, got {len(prompt)} x "
                               f"{integer(body, 'n')}")
    parsed = [_parse_prompt(with_field(body, "prompt", p), request_id, tok, limits) for p in prompt]
    return dataclasses.replace(parsed[0], more=tuple(parsed[1:]), batched=True)


def _parse_prompt(body: dict, request_id: str, tok: Tokenizer, limits: Limits) -> OpenAIRequest:
    prompt_ids = _prompt_ids(body.get("prompt"), tok, limits, _add_special_tokens(body, True))
    check_prompt_ids(prompt_ids, limits.info.vocab_size, "prompt")
    # (max_completion_tokens is chat's name; sent to a completion without max_tokens, it is what the client means)
    requested, param = integer(body, "max_tokens"), "max_tokens"
    if requested is None and body.get("max_completion_tokens") is not None:
        requested, param = integer(body, "max_completion_tokens"), "max_completion_tokens"
    # vLLM's log-likelihood request: echo with max_tokens 0 answers the prompt alone (evaluation harnesses score it)
    prompt_only = requested == 0 and flag(body, "echo", False)
    parsed = _common(body, request_id, prompt_ids, limits, 1 if prompt_only else requested, limits.default_max_tokens,
                     param)
    if prompt_only:
        parsed = dataclasses.replace(parsed, generation=dataclasses.replace(parsed.generation, prompt_only=True))
    if not parsed.options.echo:
        return parsed
    prompt = body["prompt"]  # a string echoes as sent; token ids as their decode (vLLM does the same)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    text = prompt if isinstance(prompt, str) else tok.decode(prompt_ids, parsed.options.skip_special_tokens)
    return dataclasses.replace(parsed, echo_text=text)


def parse_chat(body: dict, request_id: str, tok: Tokenizer, template: ChatTemplate | None,
               limits: Limits, formats: AnswerFormats = AnswerFormats()) -> OpenAIRequest:
    """``formats``: what the server reads chat answers into (--reasoning-parser, --tool-call-parser)."""
    messages = _messages(body.get("messages"))
    limits.prompt_bound.check(sum(len(m["content"]) for m in messages), limits.info.max_context, "messages")
    if template is None:
        raise bad_request("messages", "this model has no chat template (tokenizer_config.json has no "
                                      "chat_template); send a plain prompt to /v1/completions instead")
    text = render_chat(template, body, messages, reads_tool_calls=formats.tools is not None)
    limits.prompt_bound.check(len(text), limits.info.max_context, "messages")
    # The template renders its own BOS; the tokenizer's would double it (vLLM: add_special_tokens=False for chat).
    prompt_ids = tok.encode(text, add_special_tokens=_add_special_tokens(body, False))
    check_prompt_ids(prompt_ids, limits.info.vocab_size, "messages")
    # max_completion_tokens is the newer name and wins; without either, chat may use all the room
    # the context leaves (as vLLM does), bounded by --max-tokens-limit.
    requested = integer(body, "max_completion_tokens")
    param = "max_completion_tokens"
    if requested is None:
        requested, param = integer(body, "max_tokens"), "max_tokens"
    parsed = _common(body, request_id, prompt_ids, limits, requested, limits.defaults.max_tokens, param, "messages",
                     chat=True)
    continued = (messages[-1]["content"] if flag(body, "continue_final_message", False)
                 and messages[-1]["role"] == "assistant" else None)
    template_kwargs = body.get("chat_template_kwargs")  # (checked by render_chat: an object)
    answers = formats.for_request(tool_calls_asked(body), flag(body, "separate_reasoning", True),
                                  flag(body, "include_reasoning", True), template_kwargs or {}, continued)
    if answers.reads:
        parsed = dataclasses.replace(parsed, answers=answers)
    # a server whose parsers read special-token markup decodes every chat answer with it (the same text whether or not
    # this request has it parsed), unless the request says otherwise
    if formats.keeps_special_tokens and body.get("skip_special_tokens") is None:
        parsed = _keep_special_tokens(parsed)
    # vLLM's chat echo: the answer starts with the last message when it is the assistant's own (continued)
    if parsed.options.echo and messages[-1]["role"] == "assistant":
        return dataclasses.replace(parsed, echo_text=messages[-1]["content"])
    return parsed


def _keep_special_tokens(parsed: OpenAIRequest) -> OpenAIRequest:
    """The request's answer decoded with its special tokens (as vLLM decodes for Kimi's tool-call markup)."""
    return dataclasses.replace(parsed, options=dataclasses.replace(parsed.options, skip_special_tokens=False),
                               generation=dataclasses.replace(parsed.generation, skip_special_tokens=False))


def _common(body: dict, request_id: str, prompt_ids: list[int], limits: Limits, requested: int | None,
            default: int | None, max_param: str = "max_tokens", prompt_param: str = "prompt",
            chat: bool = False) -> OpenAIRequest:
    check_model(body.get("model"), limits.model_names)
    for field, is_no_op in _NO_OP.items():
        if not is_no_op(body.get(field)):
            raise bad_request(field, f"is not supported by this server (got {json.dumps(body[field])[:80]})")
    output = parse_output_options(body, chat)
    engine = parse_engine_sampling(body, chat, limits.defaults, output.echo and not chat)  # (chat: no prompt logprobs)
    stream = flag(body, "stream") or False
    if stream and output.prompt_logprobs:  # (vLLM's chat refuses them streamed too)
        raise bad_request("prompt_logprobs", "is only answered whole, not streamed")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("stream_options", "must be an object")
        if not stream:
            raise bad_request("stream_options", "can only be set when stream is true")
        include_usage = flag(options, "include_usage", param="stream_options.include_usage") or False
        if flag(options, "continuous_usage_stats", param="stream_options.continuous_usage_stats"):
            raise bad_request("stream_options.continuous_usage_stats", "is not supported (usage comes in the last "
                                                                       "chunk with include_usage)")
    temperature = number(body, "temperature")
    top_p = number(body, "top_p")
    top_k = integer(body, "top_k")
    seed = integer(body, "seed")
    stop = _stop(body.get("stop"))
    d = limits.defaults  # unset fields take the model's generation_config.json values, as vLLM
    temperature = d.temperature if temperature is None else temperature
    top_p = d.top_p if top_p is None else top_p
    top_k = d.top_k if top_k is None else 0 if top_k == -1 else top_k  # -1 is vLLM's "off"
    check_sampling(temperature, top_p, top_k, seed, stop)
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), limits.info.max_context, limits.max_tokens_limit,
                                    default, max_param, prompt_param)
    check_min_tokens(engine.min_tokens, max_tokens, max_param)
    stop_token_ids = _int_list(body, "stop_token_ids")
    check_stop_token_ids(stop_token_ids, limits.info.vocab_size)
    generation = GenerationRequest(request_id, tuple(prompt_ids), max_tokens, temperature, top_p, top_k, seed,
                                   tuple(stop), tuple(stop_token_ids), flag(body, "ignore_eos") or False,
                                   output.skip_special_tokens, output.include_stop_str_in_output,
                                   **dataclasses.asdict(engine), cache_salt=check_cache_salt(body.get("cache_salt")))
    return OpenAIRequest(generation, stream, include_usage, output)


# ---- fields ------------------------------------------------------------------------------------



def _add_special_tokens(body: dict, default: bool) -> bool:
    """vLLM's extra field: the tokenizer's special tokens (BOS) around the prompt text."""
    value = flag(body, "add_special_tokens")
    return default if value is None else value


def _prompt_ids(prompt: Any, tok: Tokenizer, limits: Limits, add_special_tokens: bool = True) -> list[int]:
    # A one-element list is a batch of one: accepted, since clients wrap prompts that way.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if prompt is None:
        raise bad_request("prompt", "is required")
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt", "the prompt is empty")
        limits.prompt_bound.check(len(prompt), limits.info.max_context, "prompt")
        return tok.encode(prompt, add_special_tokens=add_special_tokens)  # as transformers: a Llama-3 prompt gets BOS
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise bad_request("prompt", "must be a string, a list of token ids, or a list of those (a batch)")


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(where, "must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text can be rendered for a text model
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"{where}.content", "only text content parts are supported")
                texts.append(part["text"])
            content = "\n".join(texts)  # (as vLLM joins a message's text parts for a template that takes strings)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"{where}.content", "must be a string or a list of text parts")
        out.append({**m, "content": content})
        if isinstance(m.get("tool_calls"), list):
            out[-1]["tool_calls"] = [_call_for_template(call) for call in m["tool_calls"]]
    return out


def _call_for_template(call: Any) -> Any:
    """An earlier answer's tool call with its ``arguments`` (OpenAI's JSON text) as the object chat templates index
    into (transformers' convention, which vLLM follows too); text that is not a JSON object stays text."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}} if isinstance(arguments, dict) else call


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise bad_request("stop", "must be a string or a list of strings")


def _int_list(body: dict, name: str) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad_request(name, "must be a list of token ids")
    return v
