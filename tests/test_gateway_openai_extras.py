"""vLLM's extras on the OpenAI API, against the fake verifier: /version, /tokenize and /detokenize
(equal to the tokenizer's own encode and decode, behind the API key), skip_special_tokens,
include_stop_str_in_output, echo, n > 1 (one generation per choice, seeds seed + i, choices
merged by index), and the sampling fields the engine does not implement refused by name."""

from __future__ import annotations

import json
import time
from pathlib import Path

import fake_verifier
import grpc
import httpx
import pytest
from gateway_harness import BOS, Stack, stack_fixture, tiny_model_copy, wait_until
from tokenizers import Tokenizer

import tandem
from gateway.openai_extras import MAX_N
from tandem.chat_template import ChatTemplate

MODEL = "bos-model"
PROMPT = "def fibonacci(n):\n    return"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The gateway tests' tokenizer with a Llama-3-like post-processor (``<|bos|> $A``), so that
    add_special_tokens makes a difference."""
    return tiny_model_copy(tmp_path_factory.mktemp("extras") / MODEL, bos_post_processor=True)


stack = stack_fixture(model_dir_from="model_dir")


@pytest.fixture(scope="module")
def ref(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _post(stack, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, timeout=10, **kw)


# ---- /version, /tokenize, /detokenize -----------------------------------------------------------

def test_version(stack):
    r = httpx.get(f"{stack.url}/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": tandem.__version__}


def test_tokenize_a_prompt_as_the_completion_path_does(stack, ref):
    r = _post(stack, "/tokenize", {"model": MODEL, "prompt": PROMPT}).json()
    ids = ref.encode(PROMPT, add_special_tokens=True).ids
    assert ids[0] == ref.token_to_id(BOS)
    assert (r["tokens"], r["count"], r["max_model_len"]) == (ids, len(ids), 512)
    _post(stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert list(stack.fake.requests[-1].prompt_token_ids) == ids  # what a completion sends upstream
    r = _post(stack, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert r["tokens"] == ref.encode(PROMPT, add_special_tokens=False).ids


def test_tokenize_messages_as_the_chat_path_does(stack, ref, model_dir):
    template = ChatTemplate.from_model_dir(model_dir)
    r = _post(stack, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
    ids = ref.encode(template.render(MESSAGES, add_generation_prompt=True), add_special_tokens=False).ids
    assert r["tokens"] == ids and r["count"] == len(ids)
    _post(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert list(stack.fake.requests[-1].prompt_token_ids) == ids
    r = _post(stack, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert r["tokens"] == ref.encode(template.render(MESSAGES, add_generation_prompt=False),
                                     add_special_tokens=False).ids


def test_a_messages_text_parts_are_joined_by_newlines_as_vllm_joins_them(stack, ref, model_dir):
    template = ChatTemplate.from_model_dir(model_dir)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    ids = ref.encode(template.render([{"role": "user", "content": "a\nb"}], add_generation_prompt=True),
                     add_special_tokens=False).ids
    assert _post(stack, "/tokenize", {"messages": parts}).json()["tokens"] == ids
    _post(stack, "/v1/chat/completions", {"messages": parts, "max_tokens": 1})
    assert list(stack.fake.requests[-1].prompt_token_ids) == ids


def test_every_served_model_name_is_listed_and_retrieved_by_itself():
    s = Stack(served_model_name="main-name", served_model_aliases=("alias-2",))
    try:
        listed = httpx.get(f"{s.url}/v1/models", timeout=10).json()["data"]
        assert [card["id"] for card in listed] == ["main-name", "alias-2"]
        for name in ("main-name", "alias-2"):
            assert httpx.get(f"{s.url}/v1/models/{name}", timeout=10).json()["id"] == name
        # vLLM answers with the name the request used (serving_engine's _get_model_name), its first one without
        for sent, answered in (("alias-2", "alias-2"), ("main-name", "main-name"), (None, "main-name")):
            named = {"max_tokens": 1} | ({"model": sent} if sent else {})
            r = _post(s, "/v1/completions", {**named, "prompt": "x"})
            assert r.status_code == 200 and r.json()["model"] == answered, (sent, r.text)
            r = _post(s, "/v1/chat/completions", {**named, "messages": [{"role": "user", "content": "x"}],
                                                  "stream": True})
            chunk = json.loads(r.text.split("\n\n")[0].removeprefix("data: "))
            assert r.status_code == 200 and chunk["model"] == answered, (sent, r.text)
    finally:
        s.close()


def test_every_streamed_chat_choice_carries_vllms_stop_reason(stack):
    """vLLM's stream choices all hold stop_reason (null until a stop ends the choice), the role's chunk too."""
    r = _post(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "stream": True, "n": 2})
    chunks = [json.loads(e.removeprefix("data: ")) for e in r.text.strip().split("\n\n") if e != "data: [DONE]"]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert len(choices) >= 4 and all("stop_reason" in c for c in choices), r.text


def test_detokenize_keeps_special_tokens_as_the_tokenizer_decodes(stack, ref):
    ids = ref.encode(PROMPT).ids + [ref.token_to_id("<|eos|>")]
    r = _post(stack, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": ref.decode(ids, skip_special_tokens=False)}
    assert r.json()["prompt"].startswith(BOS) and r.json()["prompt"].endswith("<|eos|>")


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, 10 ** 6]}, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, "model"),
])
def test_tokenizer_endpoints_refuse_bad_input_naming_the_field(stack, path, body, param):
    r = _post(stack, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_api_key_guards_the_tokenizer_endpoints_as_v1():
    s = Stack(api_key="sesame", max_concurrent_requests=2)
    try:
        key = {"Authorization": "Bearer sesame"}
        for method, path, body in [("GET", "/version", None), ("POST", "/tokenize", {"prompt": "x"}),
                                   ("POST", "/detokenize", {"tokens": [5]})]:
            assert httpx.request(method, f"{s.url}{path}", json=body, timeout=10).status_code == 401
            assert httpx.request(method, f"{s.url}{path}", json=body, headers=key, timeout=10).status_code == 200
        assert httpx.get(f"{s.url}/health", timeout=10).status_code in (200, 503)  # probes stay open
        # Each choice is a generation on the verifier: n = 3 needs 3 of the 2 slots, which no wait can give.
        r = _post(s, "/v1/completions", {"prompt": "x", "n": 3, "temperature": 1, "max_tokens": 2}, headers=key)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and s.gateway.slots.in_use == 0
    finally:
        s.close()


# ---- skip_special_tokens, include_stop_str_in_output ----------------------------------------------

@pytest.fixture
def scripted(monkeypatch):
    """Make the fake verifier generate ``out`` (special tokens included) for every prompt."""
    def script(out: list[int]):
        monkeypatch.setattr(fake_verifier, "expected_tokens", lambda prompt, n, vocab: out[:n])
    return script


def test_skip_special_tokens(stack, ref, scripted):
    out = [ref.token_to_id(BOS)] + ref.encode("x = 1", add_special_tokens=False).ids + [ref.token_to_id("<|pad|>")]
    scripted(out)
    body = {"prompt": PROMPT, "max_tokens": len(out)}
    assert _post(stack, "/v1/completions", body).json()["choices"][0]["text"] == ref.decode(out)
    kept = ref.decode(out, skip_special_tokens=False)
    assert kept.startswith(BOS) and kept.endswith("<|pad|>")
    r = _post(stack, "/v1/completions", {**body, "skip_special_tokens": False}).json()
    assert r["choices"][0]["text"] == kept
    chunks = _stream(stack, "/v1/completions", {**body, "skip_special_tokens": False})
    assert "".join(c["choices"][0]["text"] for c in chunks) == kept
    chat = _post(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": len(out),
                                                 "skip_special_tokens": False}).json()
    assert chat["choices"][0]["message"]["content"] == kept


def test_stop_token_text_is_left_out_unless_asked(stack, ref, scripted):
    eos = ref.token_to_id("<|eos|>")
    out = ref.encode("y = 2", add_special_tokens=False).ids + [eos]
    scripted(out)
    body = {"prompt": PROMPT, "max_tokens": 16, "stop_token_ids": [eos], "skip_special_tokens": False}
    r = _post(stack, "/v1/completions", body).json()["choices"][0]
    assert (r["text"], r["finish_reason"]) == (ref.decode(out[:-1]), "stop")
    r = _post(stack, "/v1/completions", {**body, "include_stop_str_in_output": True}).json()["choices"][0]
    assert r["text"] == ref.decode(out, skip_special_tokens=False) and r["text"].endswith("<|eos|>")
    # The model's own EOS: vLLM's stop_reason is null, SGLang's matched names the token
    del body["stop_token_ids"]
    r = _post(stack, "/v1/completions", body).json()["choices"][0]
    assert (r["text"], r["finish_reason"], r["stop_reason"]) == (ref.decode(out[:-1]), "stop", None)
    sglang = _post(stack, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 16}}).json()
    assert sglang["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(stack, ref, stream):
    # what the fake verifier answers, decoded by the tokenizer itself: the text a stop string cuts
    whole = ref.decode(stack.expected(ref.encode(PROMPT).ids, 40))
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    cut = whole.find(stop)
    body = {"prompt": PROMPT, "max_tokens": 40, "stop": [stop]}
    for include, expected, field in [(False, whole[:cut], "include_stop_str_in_output"),
                                     (True, whole[:cut + len(stop)], "include_stop_str_in_output"),
                                     (True, whole[:cut + len(stop)], "no_stop_trim")]:  # (SGLang's spelling)
        b = {**body, field: include}
        if stream:
            text = "".join(c["choices"][0]["text"] for c in _stream(stack, "/v1/completions", b))
        else:
            text = _post(stack, "/v1/completions", b).json()["choices"][0]["text"]
        assert text == expected


# ---- return_token_ids (vLLM) ---------------------------------------------------------------------

def test_return_token_ids_gives_the_prompts_and_each_choices_ids(stack, ref, scripted):
    """As vLLM answers it: a completion choice's prompt_token_ids and token_ids, the EOS that ended it in the ids but
    not in the text; none of them unless asked."""
    eos = ref.token_to_id("<|eos|>")
    out = ref.encode("y = 2", add_special_tokens=False).ids + [eos]
    scripted(out)
    prompt_ids = ref.encode(PROMPT).ids
    body = {"prompt": PROMPT, "max_tokens": 16, "return_token_ids": True}
    choice = _post(stack, "/v1/completions", body).json()["choices"][0]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (prompt_ids, out)
    assert choice["text"] == ref.decode(out[:-1]) and ref.decode(choice["token_ids"]).startswith(choice["text"])
    for off in ({"return_token_ids": False}, {}):
        plain = _post(stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, **off}).json()["choices"][0]
        assert "token_ids" not in plain and "prompt_token_ids" not in plain
    # streamed: each chunk its new ids, the first chunk of each choice its prompt's
    chunks = _stream(stack, "/v1/completions", {**body, "n": 2, "temperature": 1})
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in mine[1:])
        assert sum((c["token_ids"] for c in mine), []) == out


def test_chat_return_token_ids_gives_the_rendered_prompts_ids_on_the_response(stack, ref, scripted, model_dir):
    eos = ref.token_to_id("<|eos|>")
    out = ref.encode("fine", add_special_tokens=False).ids + [eos]
    scripted(out)
    rendered = ChatTemplate.from_model_dir(model_dir).render(MESSAGES, add_generation_prompt=True)
    prompt_ids = ref.encode(rendered, add_special_tokens=False).ids
    body = {"messages": MESSAGES, "max_tokens": 16, "return_token_ids": True}
    r = _post(stack, "/v1/chat/completions", body).json()
    assert list(stack.fake.requests[-1].prompt_token_ids) == r["prompt_token_ids"] == prompt_ids
    assert r["choices"][0]["token_ids"] == out and r["choices"][0]["message"]["content"] == ref.decode(out[:-1])
    chunks = _stream(stack, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks), []) == out
    chunks = _stream(stack, "/v1/chat/completions", {**body, "n": 2, "temperature": 1})  # (each choice's role chunk)
    assert [c["choices"][0]["index"] for c in chunks if "prompt_token_ids" in c] == [0, 1]
    assert "prompt_token_ids" not in _post(stack, "/v1/chat/completions", {**body, "return_token_ids": False}).json()


# ---- echo ---------------------------------------------------------------------------------------

def test_echo_puts_the_prompt_before_the_text(stack, ref):
    ids = ref.encode(PROMPT).ids
    generated = ref.decode(stack.expected(ids, 12))
    r = _post(stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "echo": True}).json()
    assert r["choices"][0]["text"] == PROMPT + generated
    assert r["usage"]["completion_tokens"] == 12
    chunks = _stream(stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "echo": True})
    assert chunks[0]["choices"][0]["text"] == PROMPT  # sent first
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + generated
    # A prompt of token ids echoes as their decode.
    r = _post(stack, "/v1/completions", {"prompt": ids, "max_tokens": 3, "echo": True,
                                         "skip_special_tokens": False}).json()
    assert r["choices"][0]["text"] == ref.decode(ids, skip_special_tokens=False) + ref.decode(stack.expected(ids, 3))


def test_chat_echo_starts_the_answer_with_the_assistants_last_message(stack, ref):
    """vLLM's chat echo: when the last message is the assistant's own (to be continued), the answer starts
    with it, whole and streamed; after a user's message there is nothing to echo."""
    continued = MESSAGES + [{"role": "assistant", "content": "Sure: "}]
    body = {"messages": continued, "max_tokens": 6, "echo": True, "continue_final_message": True,
            "add_generation_prompt": False}
    sent_before = len(stack.fake.requests)
    r = _post(stack, "/v1/chat/completions", body).json()
    prompt_ids = list(stack.fake.requests[sent_before].prompt_token_ids)
    generated = ref.decode(stack.expected(prompt_ids, 6))
    assert r["choices"][0]["message"]["content"] == "Sure: " + generated
    chunks = _stream(stack, "/v1/chat/completions", body)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Sure: " + generated
    r = _post(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, "echo": True}).json()
    prompt_ids = list(stack.fake.requests[-1].prompt_token_ids)
    assert r["choices"][0]["message"]["content"] == ref.decode(stack.expected(prompt_ids, 6))


# ---- n > 1 --------------------------------------------------------------------------------------

def test_n_fans_out_with_distinct_seeds(stack, ref):
    before = len(stack.fake.requests)
    r = _post(stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 9, "n": 3, "temperature": 0.8,
                                         "seed": 41}).json()
    upstream = stack.fake.requests[before:]
    assert sorted(u.sampling.seed for u in upstream) == [41, 42, 43]
    assert len({u.request_id for u in upstream}) == 3
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    text = ref.decode(stack.expected(ref.encode(PROMPT).ids, 9))
    assert all(c["text"] == text and c["finish_reason"] == "length" for c in r["choices"])
    assert r["usage"]["completion_tokens"] == 27 and r["usage"]["prompt_tokens"] == len(ref.encode(PROMPT).ids)
    # Unseeded choices stay unseeded: the verifier draws each one's randomness itself.
    before = len(stack.fake.requests)
    _post(stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 2, "temperature": 1.0})
    assert [u.sampling.HasField("seed") for u in stack.fake.requests[before:]] == [False, False]


def test_n_streamed_chunks_carry_their_index(stack, ref):
    stack.fake.delay_s = 0.002  # interleave the choices' messages
    try:
        body = {"prompt": PROMPT, "max_tokens": 10, "n": 3, "temperature": 1.0, "stream": True,
                "stream_options": {"include_usage": True}}
        *chunks, usage = _stream(stack, "/v1/completions", body)
        texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(3)}
        expected = ref.decode(stack.expected(ref.encode(PROMPT).ids, 10))
        assert texts == {0: expected, 1: expected, 2: expected}
        assert sum(c["choices"][0]["finish_reason"] == "length" for c in chunks) == 3
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 30
        chat = _stream(stack, "/v1/chat/completions", {**body, "messages": MESSAGES, "prompt": None, "n": 2})
        roles = [c["choices"][0]["index"] for c in chat if c["choices"] and "role" in c["choices"][0]["delta"]]
        assert roles == [0, 1]
    finally:
        stack.fake.delay_s = 0.0


def test_a_batch_of_prompts_gives_each_its_choices_in_order(stack, ref):
    """A list of prompts (vLLM, the OpenAI API: evaluation harnesses send them) is one generation per prompt and
    choice: choice p * n + j is prompt p's j-th (seed + j), with its own echo; usage counts each prompt once.
    Streamed, each chunk carries its choice's index."""
    prompts = [PROMPT, "x = 1", [ref.token_to_id(BOS), 5, 6, 7]]  # text, text, token ids
    ids = [ref.encode(prompts[0]).ids, ref.encode(prompts[1]).ids, prompts[2]]
    before = len(stack.fake.requests)
    body = {"prompt": prompts, "max_tokens": 4, "n": 2, "temperature": 0.8, "seed": 5, "echo": True}
    r = _post(stack, "/v1/completions", body).json()
    upstream = stack.fake.requests[before:]
    assert sorted((list(u.prompt_token_ids), u.sampling.seed) for u in upstream) == \
        sorted((p, s) for p in ids for s in (5, 6))
    assert len({u.request_id for u in upstream}) == 6
    assert [c["index"] for c in r["choices"]] == list(range(6))
    for i, choice in enumerate(r["choices"]):
        p = i // 2
        echo = prompts[p] if isinstance(prompts[p], str) else ref.decode(ids[p], skip_special_tokens=True)
        assert choice["text"] == echo + ref.decode(stack.expected(ids[p], 4)), i
    assert r["usage"]["prompt_tokens"] == sum(len(i) for i in ids) and r["usage"]["completion_tokens"] == 24
    chunks = _stream(stack, "/v1/completions", {**body, "echo": False, "n": 1, "stream_options": {"include_usage": True}})
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"][0]["index"] == i) for i in range(3)}
    assert texts == {p: ref.decode(stack.expected(ids[p], 4)) for p in range(3)}
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_n_greedy_asks_each_choice_greedily(stack, client):
    before = len(stack.fake.requests)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, temperature=0)
    sent = stack.fake.requests[before:]
    assert len(r.choices) == 2 and len(sent) == 2 and all(q.sampling.temperature == 0 for q in sent)
    assert len({q.request_id for q in sent}) == 2 and r.choices[0].message.content == r.choices[1].message.content


def test_n_refusal_by_the_verifier_cancels_the_other_choices(stack):
    before = len(stack.fake.requests)
    stack.fake.delay_s = 0.05
    stack.fake.fail_with = (grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    try:
        r = _post(stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 50, "n": 3, "temperature": 1.0})
        assert r.status_code == 429

        def others_cancelled() -> bool:  # every choice that reached the verifier, but the refused one
            ids = {u.request_id for u in stack.fake.requests[before:]}
            return len(ids & set(stack.fake.cancelled)) == len(ids) - 1
        # (a choice the gateway cancels before its call reaches the verifier is never seen there at all)
        wait_until(lambda: others_cancelled() and stack.gateway.slots.in_use == 0, what="the other choices cancelled")
        time.sleep(1.0)  # a choice left running would finish its 50 tokens (0.05 s apart) by now
        assert not {u.request_id for u in stack.fake.requests[before:]} & set(stack.fake.finished)
    finally:
        stack.fake.delay_s = 0.0


@pytest.mark.parametrize("n", [0, MAX_N + 1, 2.5, "2", True])
def test_n_out_of_range_is_refused(stack, n):
    r = _post(stack, "/v1/completions", {"prompt": PROMPT, "n": n, "temperature": 1.0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


# ---- fields still refused -----------------------------------------------------------------------

@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "prompt_logprobs", 21), ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "skip_special_tokens", "no"),
    ("/v1/completions", "include_stop_str_in_output", 1),
    ("/v1/completions", "guided_json", {"type": "object"}), ("/v1/chat/completions", "guided_choice", ["a", "b"]),
    ("/v1/completions", "guided_regex", "a+"), ("/v1/completions", "bad_words", ["x"]),
    ("/v1/completions", "return_tokens_as_token_ids", True), ("/v1/chat/completions", "priority", 5),
    ("/v1/completions", "allowed_token_ids", [1, 2]), ("/v1/completions", "truncate_prompt_tokens", 8),
    ("/v1/chat/completions", "functions", [{"name": "f"}]), ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "chat_template", "{{ messages }}"),
    ("/v1/completions", "regex", "a+"), ("/v1/chat/completions", "json_schema", "{}"),
    ("/v1/completions", "ebnf", "root ::= 'a'"),  # SGLang's constrained output
    ("/v1/completions", "return_token_ids", "yes"), ("/v1/chat/completions", "cache_salt", ""),
    ("/v1/completions", "cache_salt", 5), ("/v1/completions", "stop_token_ids", [1] * 257),
    ("/v1/completions", "logits_processors", ["x"]), ("/v1/completions", "spaces_between_special_tokens", False),
    ("/v1/chat/completions", "lora_path", "my-lora"), ("/v1/completions", "return_hidden_states", True),
    ("/v1/completions", "prompt_embeds", "AAAA"), ("/v1/chat/completions", "prompt_embeds", "AAAA"),
])
def test_unimplemented_fields_are_refused_by_name(stack, path, field, value):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    r = _post(stack, path, {**body, field: value, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(field)


@pytest.mark.parametrize("field,value", [("min_p", 0), ("repetition_penalty", 1.0), ("min_tokens", 0),
                                         ("presence_penalty", 0), ("logprobs", None), ("logprobs", False),
                                         ("use_beam_search", False)])
def test_no_op_values_are_accepted(stack, field, value):
    assert _post(stack, "/v1/completions", {"prompt": PROMPT, field: value, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}), ("/v1/completions", {"prompt": [PROMPT, "def g():"]}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
])
def test_fields_no_parse_read_are_logged_as_ignored(stack, caplog, path, body):
    """A misspelt field answers with the default, as vLLM answers it, and is named in a warning as vLLM names it; the
    fields the parse reads (a batch's too) and OpenAI's fields without meaning here (``user``) are not."""
    import logging

    sent = {**body, "temprature": 0, "max_tokens": 2, "seed": 3, "top_p": 0.9, "user": "u1", "stop": ["x"]}
    with caplog.at_level(logging.WARNING, logger="gateway.rest"):
        assert _post(stack, path, sent).status_code == 200
    (line,) = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert line.endswith("fields present in the request but ignored: temprature")


def test_the_model_may_be_named_by_its_path_as_vllm_names_it(stack, model_dir):
    """Without --served-model-name vLLM's and SGLang's model name is the path they were given: clients written
    for them send it. The served name stays what /v1/models lists; another path is still 404."""
    for name in (str(model_dir), MODEL):  # (answered under the name it was asked by, as vLLM answers)
        r = _post(stack, "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == name, r.text
    assert _post(stack, "/v1/completions", {"model": str(model_dir.parent), "prompt": PROMPT}).status_code == 404
    assert [m["id"] for m in httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"]] == [MODEL]


def test_ping_is_health_and_both_answer_head(stack):
    for path in ("/health", "/ping"):
        assert httpx.get(f"{stack.url}{path}", timeout=10).status_code == 200
        assert httpx.head(f"{stack.url}{path}", timeout=10).status_code == 200
    assert httpx.post(f"{stack.url}/ping", timeout=10).status_code == 200  # (vLLM's, for SageMaker's probe)


def test_a_model_is_retrieved_by_its_names_as_the_openai_client_does(stack, model_dir):
    listed = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]
    for name in (MODEL, str(model_dir)):
        r = httpx.get(f"{stack.url}/v1/models/{name}", timeout=10)
        assert r.status_code == 200 and r.json() == listed, r.text
    r = httpx.get(f"{stack.url}/v1/models/other-model", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert httpx.get(f"{stack.url}/v1/models/", timeout=10).json() == {"object": "list", "data": [listed]}


def test_continuous_usage_stats_is_refused_by_name(stack):
    r = _post(stack, "/v1/completions", {"prompt": PROMPT, "stream": True, "max_tokens": 2,
                                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.continuous_usage_stats", r.text


def _stream(stack, path: str, body: dict) -> list[dict]:
    body = {k: v for k, v in body.items() if v is not None} | {"stream": True}
    with httpx.stream("POST", f"{stack.url}{path}", json=body, timeout=10) as r:
        assert r.status_code == 200, r.read()
        events = r.read().decode().split("\n\n")
    assert events[-2] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_cache_salt_reaches_the_verifier(stack, path):
    """(The engine's sharing by salt: tests/test_prefix_cache_engine.py.)"""
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    for salt, sent in (("tenant-a", "tenant-a"), (None, "")):
        r = _post(stack, path, {**body, "max_tokens": 2, "n": 2, **({} if salt is None else {"cache_salt": salt})})
        assert r.status_code == 200, r.text
        assert [q.cache_salt for q in stack.fake.requests[-2:]] == [sent, sent]
