"""The REST API against the real gateway and a real CPU verifier. Fuzzing (hypothesis) on a tiny
model: random JSON bodies with random field types and values (the API's own fields and others,
boundary numbers, lone surrogates, long strings), random JSON that is not an object, random bytes.
Never a 5xx, never a dropped connection, never a hang (each request has a deadline); every refusal
is an OpenAI error body, every success a complete response or SSE stream. And the verifier's own
refusal of a prompt its KV cache can never hold, as the client sees it."""

from __future__ import annotations

import json

import httpx
import pytest
from gateway_harness import Stack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services import Service, free_port

pytestmark = pytest.mark.slow
EXAMPLES = 200
CONTEXT = 256
MAX_TOKENS = 6  # --max-tokens-limit: generations stay short, larger asks are refused
REQUEST_DEADLINE_S = 20.0
counted = {"requests": 0, "statuses": {}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from checkpoints import write_checkpoint
    from tandem.training.stdlib_text import train_tokenizer

    target = tmp_path_factory.mktemp("fuzz") / "tiny"
    write_checkpoint(target, "llama", seed=3, num_hidden_layers=2, vocab_size=512, eos_token_id=1,
                     max_position_embeddings=CONTEXT)
    train_tokenizer(target, vocab_size=512)
    return target


def _real_stack(model_dir, *verifier_args):
    verifier = Service("verifier", ["--model", str(model_dir), *verifier_args], free_port(),
                       model_dir.parent / f"verifier-{free_port()}.log").start()
    return verifier, Stack(verifier=verifier.address, model_dir=model_dir, max_tokens_limit=MAX_TOKENS,
                           max_body_bytes=64 << 10)


@pytest.fixture(scope="module")
def stack(model_dir):
    verifier, s = _real_stack(model_dir)
    yield s
    s.close()
    verifier.stop()


# Values at the edges of what each layer takes (int32, uint32, uint64, float32, the context), and
# strings that are not text or are long.
EDGE_NUMBERS = [0, 1, -1, 2, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64, -2 ** 63, 10 ** 30, 0.5, 1e-50, 1e-46,
                1e-30, 1e300, -0.0, 100.0, 100.1, CONTEXT, CONTEXT + 1, float("nan"), float("inf"), -float("inf")]
EDGE_TEXT = ["", " ", "\ud800", "a\udfffb", "\udbff\udbff", "日本語", "😀", "\x00", "<|eos|>", "x" * 5000]
NUMBERS = st.one_of(st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(EDGE_NUMBERS))
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(EDGE_TEXT),
                 st.text(alphabet="ab \n", min_size=900, max_size=3000))
EDGE_OTHER = [[], {}, [EDGE_TEXT[2]], [2 ** 31], [-1], True, None]
SCALAR = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
ANY = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TEXT, inner, max_size=4),
                   max_leaves=10)
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 600), NUMBERS), max_size=CONTEXT + 8)
MESSAGE = st.fixed_dictionaries({}, optional={"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), ANY),
                                              "content": st.one_of(TEXT, ANY, st.lists(st.fixed_dictionaries(
                                                  {"type": st.sampled_from(["text", "image_url"]), "text": TEXT})))})
FIELDS = {
    "model": st.one_of(st.just("tiny"), TEXT, ANY),
    "prompt": st.one_of(TEXT, TOKEN_IDS, st.lists(TEXT, max_size=2), ANY),
    "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), ANY),
    "max_tokens": st.one_of(st.integers(-2, MAX_TOKENS + 2), NUMBERS, ANY),
    "max_completion_tokens": st.one_of(st.integers(-2, MAX_TOKENS + 2), NUMBERS),
    "temperature": st.one_of(st.floats(0, 2), NUMBERS, ANY), "top_p": st.one_of(st.floats(0, 1), NUMBERS),
    "top_k": st.one_of(st.integers(-2, 600), NUMBERS), "seed": st.one_of(st.integers(0, 2 ** 64), NUMBERS),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=20), ANY),
    "stream": st.one_of(st.booleans(), ANY), "stream_options": st.one_of(st.fixed_dictionaries(
        {"include_usage": st.one_of(st.booleans(), ANY)}), ANY),
    "stop_token_ids": st.one_of(TOKEN_IDS, ANY), "ignore_eos": st.one_of(st.booleans(), ANY),
    **{name: ANY for name in ("n", "best_of", "echo", "logprobs", "top_logprobs", "suffix", "presence_penalty",
                              "frequency_penalty", "logit_bias", "tools", "response_format", "user")},
}
# Bodies a client means to be valid, then 0-2 fields replaced by anything: most requests reach
# tokenization, the verifier and the stream, and each odd value meets the code that follows it.
VALID_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
VALID = {
    "max_tokens": st.integers(1, MAX_TOKENS), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 600), "seed": st.integers(0, 2 ** 64 - 1), "stream": st.booleans(),
    "stop": st.lists(VALID_TEXT, max_size=3), "ignore_eos": st.booleans(),
}
COMPLETION = st.fixed_dictionaries({"prompt": st.one_of(VALID_TEXT, st.lists(st.integers(3, 511), min_size=1,
                                                                                 max_size=40))}, optional=VALID)
CHAT = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": VALID_TEXT}), min_size=1, max_size=3)},
    optional={k: v for k, v in VALID.items() if k != "max_tokens"} | {"max_completion_tokens": VALID["max_tokens"]})


# The fields that reach tokenization, the verifier's protobuf and the stop strings, drawn more often,
# half the time with an edge value of their kind.
_TEXT_FIELDS = ("prompt", "model", "stop")
_NUMBER_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed")
_KEYS = sorted(FIELDS) + list(_TEXT_FIELDS + _NUMBER_FIELDS + ("messages", "stop_token_ids")) * 3
_EDGES = {**{k: st.sampled_from(EDGE_TEXT) for k in _TEXT_FIELDS},
          **{k: st.sampled_from(EDGE_NUMBERS) for k in _NUMBER_FIELDS},
          "messages": st.sampled_from(EDGE_TEXT).map(lambda t: [{"role": "user", "content": t}]),
          "stop_token_ids": st.sampled_from(EDGE_NUMBERS).map(lambda n: [n])}


def _mutated(base):
    def values(keys):
        edges = {k: _EDGES.get(k, st.sampled_from(EDGE_OTHER)) for k in keys}
        return st.fixed_dictionaries({k: st.one_of(edges[k], FIELDS[k]) for k in keys})

    return st.tuples(base, st.lists(st.sampled_from(_KEYS), min_size=1, max_size=2).flatmap(values),
                     st.dictionaries(TEXT, ANY, max_size=1)).map(lambda t: {**t[2], **t[0], **t[1]})


def _requests(path: str):
    base = COMPLETION if path == "/v1/completions" else CHAT
    return st.one_of(
        st.tuples(st.just("json"), base), st.tuples(st.just("json"), _mutated(base)),
        st.tuples(st.just("json"), _mutated(base)),
        st.tuples(st.just("json"), st.fixed_dictionaries({}, optional=FIELDS)),  # anything in any field
        st.tuples(st.just("json"), ANY),  # valid JSON, not necessarily an object
        st.tuples(st.just("bytes"), st.binary(max_size=300)),
    )


def _check(r: httpx.Response, stream: bool) -> None:
    assert r.status_code < 500, r.text[:500]
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == r.status_code, error
        return
    if stream:
        events = [line for line in r.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]", events[-3:]
        for e in events[:-1]:
            chunk = json.loads(e.removeprefix("data: "))
            assert "error" not in chunk, chunk
    else:
        body = r.json()
        assert body["choices"][0]["finish_reason"] in ("stop", "length"), body
        assert body["usage"]["completion_tokens"] <= MAX_TOKENS


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def _fuzz(stack, client, data):
    path = data.draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), "path")
    kind, payload = data.draw(_requests(path), "request")
    if kind == "json":
        content = json.dumps(payload).encode()  # NaN/Infinity literals and \ud800 escapes included
    else:
        content = payload
    stream = isinstance(payload, dict) and payload.get("stream") is True
    counted["requests"] += 1
    # httpx raises on a dropped connection or a response later than the deadline: both fail the test.
    r = client.post(f"{stack.url}{path}", content=content, headers={"content-type": "application/json"})
    counted["statuses"][r.status_code] = counted["statuses"].get(r.status_code, 0) + 1
    _check(r, stream)


def test_the_rest_api_never_fails_on_random_input(stack):
    with httpx.Client(timeout=REQUEST_DEADLINE_S) as client:
        _fuzz(stack, client)
        assert client.get(f"{stack.url}/health").status_code == 200  # and it is still serving
    print(f"fuzzed {counted['requests']} requests, by status: {dict(sorted(counted['statuses'].items()))}")
    assert counted["requests"] >= EXAMPLES


def test_every_edge_value_in_every_field_is_answered_cleanly(stack):
    """The deterministic complement of the fuzz: each edge value alone in each field of a valid body."""
    cases = [(k, v) for k in _TEXT_FIELDS for v in EDGE_TEXT] + [(k, v) for k in _NUMBER_FIELDS for v in EDGE_NUMBERS]
    cases += [("messages", [{"role": "user", "content": t}]) for t in EDGE_TEXT]
    cases += [("stop_token_ids", [n]) for n in EDGE_NUMBERS] + [(k, v) for k in FIELDS for v in EDGE_OTHER]
    with httpx.Client(timeout=REQUEST_DEADLINE_S) as client:
        for stream in (False, True):
            for field, value in cases:
                path = "/v1/chat/completions" if field in ("messages", "max_completion_tokens") else "/v1/completions"
                chat = path.endswith("chat/completions")
                base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
                body = {**base, "max_tokens": 2, "stream": stream, field: value}
                r = client.post(f"{stack.url}{path}", content=json.dumps(body).encode(),
                                headers={"content-type": "application/json"})
                _check(r, body["stream"] is True)
    print(f"edge matrix: {2 * len(cases)} requests")


def test_a_prompt_larger_than_the_real_kv_cache_is_400_not_429(model_dir):
    """The verifier refuses a prompt its whole KV cache cannot hold as OUT_OF_RANGE (a full queue is
    RESOURCE_EXHAUSTED); the gateway tells the client it is the prompt, not a moment to retry."""
    verifier, s = _real_stack(model_dir, "--kv-pages", "3", "--page-size", "16")  # 2 usable pages: 32 tokens
    try:
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": list(range(3, 43)), "max_tokens": 1}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "KV cache" in r.text
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": list(range(3, 13)), "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        s.close()
        verifier.stop()

