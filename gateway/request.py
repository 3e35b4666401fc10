"""What one generation asks of the verifier, and the checks both front ends (REST and gRPC) apply
before sending it: the same field, the same limit, the same message."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.errors import GatewayError, bad_request
from tandem.rpc.verifier.v1 import verifier_pb2
from tandem.sampling_limits import MAX_STOP_TOKEN_IDS

_UINT64_MAX = (1 << 64) - 1
_INT32_MAX = (1 << 31) - 1  # top_k and token ids travel as int32
_UINT32_MAX = (1 << 32) - 1  # max_tokens as a uint32
MAX_STOP_STRINGS = 16  # each one is searched in the text after every message
MAX_STOP_CHARS = 256  # and text that could start one is held back, so each is bounded too
MAX_TEMPERATURE = 100.0  # the distribution is uniform to float32 precision long before; above is a mistake

OFFLOAD_PARSE_BYTES = 16_384  # prompts above this size are tokenized on a worker thread, off the event loop


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0  # the OpenAI default; 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # cut on the detokenized text by the gateway
    stop_token_ids: tuple[int, ...] = ()  # checked by the verifier, besides its EOS ids
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # in the text (the gateway's side: the verifier sends ids)
    include_stop_str_in_output: bool = False  # the matched stop string, or the stop token's text
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; N: each token's log-probability and its top N alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo) ...
    prompt_logprobs_from: int = 1  # ... from this one on (SGLang's logprob_start_len + 1; before it: None entries)
    # vLLM's echo with max_tokens 0: the prompt (and its log-probabilities) alone; the verifier makes one token, unsent
    prompt_only: bool = False
    cache_salt: str = ""  # vLLM's: cached prefix pages shared only with requests of the same salt

    def to_proto(self) -> verifier_pb2.GenerateRequest:
        sampling = verifier_pb2.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, max_new_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos, stop_token_ids=list(self.stop_token_ids), min_p=self.min_p,
            min_tokens=self.min_tokens, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)
        if self.seed is not None:
            sampling.seed = self.seed
        if self.logprobs is not None:
            sampling.logprobs = self.logprobs
        if self.prompt_logprobs is not None:
            sampling.prompt_logprobs = self.prompt_logprobs
            sampling.prompt_logprobs_from = self.prompt_logprobs_from
        return verifier_pb2.GenerateRequest(request_id=self.request_id, prompt_token_ids=list(self.prompt_ids),
                                            sampling=sampling, cache_salt=self.cache_salt)

    def span_attributes(self) -> dict:
        # gen_ai.* semantic-convention names, as vLLM's request spans use them.
        return {"gen_ai.request.id": self.request_id, "gen_ai.request.max_tokens": self.max_tokens,
                "gen_ai.request.temperature": self.temperature, "gen_ai.request.top_p": self.top_p}


def check_sampling(temperature: float, top_p: float, top_k: int, seed: int | None,
                   stop: Sequence[str]) -> None:
    """Raise a 400 naming the first bad sampling field."""
    if not math.isfinite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise bad_request("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}] (0 is greedy), "
                                         f"got {temperature}")
    # The verifier receives 32-bit floats: 1e-50 would arrive as 0, which it reads as "unset" (1.0).
    if not math.isfinite(top_p) or not 0 < _float32(top_p) <= 1:
        raise bad_request("top_p", f"must be in (0, 1] once rounded to a 32-bit float, got {top_p}")
    if not 0 <= top_k <= _INT32_MAX:
        raise bad_request("top_k", f"must be in [0, {_INT32_MAX}] (0 turns it off), got {top_k}")
    if seed is not None and not 0 <= seed <= _UINT64_MAX:
        raise bad_request("seed", f"must be in [0, 2^64), got {seed}")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not s for s in stop):
        raise bad_request("stop", "stop strings must not be empty")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad_request("stop", f"stop strings must be at most {MAX_STOP_CHARS} characters long")


def _float32(x: float) -> float:
    """``x`` rounded to a 32-bit float, as protobuf's ``float`` fields carry it (inf beyond its range)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def check_prompt_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    if not ids:
        raise bad_request(param, "the prompt is empty")
    end = vocab_size or _INT32_MAX + 1  # a vocabulary the verifier did not state still fits an int32
    bad = next((t for t in ids if not 0 <= t < end), None)
    if bad is not None:
        raise bad_request(param, f"token id {bad} is outside the vocabulary [0, {end})")


def check_stop_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """A 400 for more stop token ids than the engine checks each step, or one outside the vocabulary."""
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(ids)}")
    if ids:
        check_prompt_ids(ids, vocab_size, "stop_token_ids")


def resolve_max_tokens(requested: int | None, prompt_len: int, max_context: int, limit: int | None,
                       default: int | None, param: str = "max_tokens", prompt_param: str = "prompt") -> int:
    """The number of tokens to generate.

    ``requested`` None takes ``default`` (None: all the room the context leaves), shortened to fit
    the context — a default should never be the reason a request fails. An explicit value that does
    not fit is refused with the numbers, the way OpenAI words it. ``max_context`` 0 means the
    verifier did not say; it then checks the context itself.
    """
    room = max_context - prompt_len if max_context else None
    if room is not None and room <= 0:
        raise bad_request(prompt_param, f"the prompt has {prompt_len} tokens, but this model's maximum context "
                                        f"length is {max_context} tokens")
    if requested is None:
        candidates = [n for n in (default, room, limit) if n is not None]
        if not candidates:
            raise bad_request(param, "is required (the model's context length is unknown)")
        return min(candidates)
    if not 1 <= requested <= _UINT32_MAX:
        zero = " (0 answers the prompt alone only on /v1/completions with echo)" if requested == 0 else ""
        raise bad_request(param, f"must be in [1, {_UINT32_MAX}], got {requested}{zero}")
    if limit is not None and requested > limit:
        raise bad_request(param, f"must be at most {limit} on this server, got {requested}")
    if room is not None and requested > room:
        raise bad_request(param, f"this model's maximum context length is {max_context} tokens, but "
                                 f"{prompt_len + requested} were requested ({prompt_len} in the prompt, "
                                 f"{requested} to generate); lower {param} to at most {room}")
    return requested


def check_model(model, served: tuple[str, ...]) -> None:
    """A request's ``model`` (None or "": the served one) must be one of the ``served`` names (the first the one
    listed): else 404 naming it."""
    if model is not None and not isinstance(model, str):
        raise bad_request("model", f"must be a string, got {type(model).__name__}")
    if model and model not in served:
        raise GatewayError(404, f"the model `{model[:100]}` does not exist; this server serves `{served[0]}`",
                           param="model")


MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(salt) -> str:
    """vLLM's ``cache_salt``: a non-empty string (None: no salt, "")."""
    if salt is None:
        return ""
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise bad_request("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
    return salt
