"""The output fields of vLLM's OpenAI server that the gateway honours without the engine's help:
``n`` (fanned out as ``n`` generations: gateway/choices.py), ``echo``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``return_token_ids`` and ``prompt_logprobs``'s place in the
response. Also vLLM's fields that nothing implements
yet, refused unless they hold their no-op value (never silently ignored)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.body_fields import flag
from gateway.errors import bad_request

MAX_N = 16  # each choice is a whole generation on the verifier: a bound keeps one request from a batch's worth

# Fields vLLM accepts that would need the engine (not implemented there): refused unless no-op.
ENGINE_FIELDS = {
    "use_beam_search": lambda v: v is None or v is False,
    # guided decoding and token restrictions (vLLM's extensions): no grammar or mask in the engine
    **{name: (lambda v: v is None) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                                "guided_decoding_backend", "structured_outputs",
                                                "regex", "json_schema", "ebnf")},  # (the last three: SGLang's)
    "bad_words": lambda v: not v,
    "allowed_token_ids": lambda v: not v,
    "truncate_prompt_tokens": lambda v: v is None,
    "prompt_embeds": lambda v: v is None,  # (vLLM takes them behind --enable-prompt-embeds; no such input here)
    # OpenAI's legacy function calling: as tools, there is no call parser (gateway/chat_request.py)
    "functions": lambda v: not v,
    "function_call": lambda v: v is None or v == "none",
    "chat_template": lambda v: v is None,  # a request's own template: only the model's renders
    "return_tokens_as_token_ids": lambda v: not v,  # log-probabilities name tokens by their text
    "priority": lambda v: v is None or (v == 0 and not isinstance(v, bool)),  # one queue, first come first served
    "logits_processors": lambda v: not v,
    "spaces_between_special_tokens": lambda v: v is None or v is True,  # (the tokenizer's detokenization, always)
    # SGLang's OpenAI-server extensions (its /generate takes the same)
    "lora_path": lambda v: not v,
    "return_hidden_states": lambda v: not v,
}


@dataclass(frozen=True)
class OutputOptions:
    n: int = 1
    echo: bool = False  # the prompt's text before each choice's (chat: the last message's, when the assistant's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for: the response carries them in vLLM's shape


def parse_output_options(body: dict, chat: bool) -> OutputOptions:
    n = body.get("n")
    if n is None:
        n = 1
    elif isinstance(n, float) and n.is_integer():
        n = int(n)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise bad_request("n", f"must be an integer in [1, {MAX_N}], got {json.dumps(n)[:40]}")
    echo = flag(body, "echo", False)
    # (SGLang's OpenAI server spells include_stop_str_in_output no_stop_trim)
    keep_stop = flag(body, "include_stop_str_in_output", False) or flag(body, "no_stop_trim", False)
    return OutputOptions(n, echo, flag(body, "skip_special_tokens", True), keep_stop,
                         flag(body, "return_token_ids", False), body.get("prompt_logprobs") is not None)




def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: distinct per choice and reproducible when the request is seeded
    (seed + index, wrapping within the uint64 the verifier takes); unseeded choices stay unseeded."""
    return None if seed is None else (seed + index) % (1 << 64)
