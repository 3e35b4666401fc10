"""The gateway's side of the engine's sampling fields, against the fake verifier: min_p, min_tokens and the
penalties travel to the verifier as sent; logprobs (completions' ``logprobs: N``, chat's ``logprobs`` with
``top_logprobs``) come back in OpenAI's shapes, read by the openai client, streamed or whole, for each of
``n`` choices. Expected values come from the fake's own rule (fake_verifier.fake_logprobs) and the
tokenizer's decode of each token, not from the gateway."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_verifier import expected_tokens, fake_logprobs
from gateway_harness import MODEL_NAME, stack_fixture, tiny_model_dir, vocab_size
from tokenizers import Tokenizer

PROMPT = "def fibonacci(n):\n    return"
MESSAGES = [{"role": "user", "content": "def f(x):"}]


stack = stack_fixture()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir() / "tokenizer.json"))


def _expected(stack, tok, k):
    """(token texts, logprobs, top alternatives as (text, logprob) lists) of the last request's output."""
    sent = stack.fake.requests[-1]
    ids = expected_tokens(list(sent.prompt_token_ids), sent.sampling.max_new_tokens, vocab_size())
    entries = [fake_logprobs(t, i, k, vocab_size()) for i, t in enumerate(ids)]
    text = lambda t: tok.decode([t], skip_special_tokens=False)  # noqa: E731
    tops = [[(text(t), max(v, -9999.0)) for t, v in zip(e.top_token_ids, e.top_logprobs)] for e in entries]
    return [text(t) for t in ids], [e.logprob for e in entries], tops


def test_sampling_fields_reach_the_verifier(stack, client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, presence_penalty=0.5,
                              frequency_penalty=-0.25, extra_body={"min_p": 0.125, "min_tokens": 3,
                                                                   "repetition_penalty": 1.5})
    s = stack.fake.requests[-1].sampling
    assert (s.min_p, s.min_tokens, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == \
        (0.125, 3, 1.5, 0.5, -0.25)
    assert not s.HasField("logprobs")  # not asked: the verifier computes none
    client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    s = stack.fake.requests[-1].sampling
    assert (s.min_p, s.min_tokens, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (0, 0, 1, 0, 0)


@pytest.mark.parametrize("k", [0, 3])
def test_completion_logprobs(stack, client, tok, k):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, logprobs=k)
    assert stack.fake.requests[-1].sampling.logprobs == k
    texts, logprobs, tops = _expected(stack, tok, k)
    lp = r.choices[0].logprobs
    assert lp.tokens == texts and lp.token_logprobs == pytest.approx(logprobs)
    for got, want, text, value in zip(lp.top_logprobs, tops, texts, logprobs):
        want = dict(want)
        want.setdefault(text, value)  # the generated token is always listed, as vLLM does
        assert got == pytest.approx(want)
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert lp.text_offset == offsets
    assert r.choices[0].text == "".join(texts)  # this tokenizer's tokens decode to their concatenation


def test_chat_logprobs(stack, client, tok):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, logprobs=True,
                                       top_logprobs=2)
    assert stack.fake.requests[-1].sampling.logprobs == 2
    texts, logprobs, tops = _expected(stack, tok, 2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == texts and [c.logprob for c in content] == pytest.approx(logprobs)
    assert [c.bytes for c in content] == [list(t.encode()) for t in texts]
    assert [[(a.token, a.logprob) for a in c.top_logprobs] for c in content] == tops  # -inf as -9999.0
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, logprobs=True)
    assert stack.fake.requests[-1].sampling.logprobs == 0
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3)
    assert r.choices[0].logprobs is None


def _events(stack, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{stack.url}{path}", json={**body, "stream": True}, timeout=10) as r:
        assert r.status_code == 200, r.read()
        events = r.read().decode().split("\n\n")
    assert events[-2] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_logprobs_equal_the_whole_response_for_each_choice(stack, path):
    chat = path.endswith("chat/completions")
    body = ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 2} if chat
            else {"prompt": PROMPT, "logprobs": 2}) | {"max_tokens": 9, "n": 2, "temperature": 1.0, "seed": 4}
    whole = httpx.post(f"{stack.url}{path}", json=body, timeout=10).json()["choices"]
    streamed: dict[int, list] = {0: [], 1: []}
    for event in _events(stack, path, body):
        for choice in event["choices"]:
            if choice["logprobs"] is not None:
                streamed[choice["index"]].append(choice["logprobs"])
    for i in (0, 1):
        if chat:
            assert [c for part in streamed[i] for c in part["content"]] == whole[i]["logprobs"]["content"]
        else:
            merged = {key: [v for part in streamed[i] for v in part[key]] for key in whole[i]["logprobs"]}
            assert merged == whole[i]["logprobs"]
    assert [u.sampling.logprobs for u in stack.fake.requests[-2:]] == [2, 2]  # every choice's generation asks
    assert all(len(c["logprobs"]["content" if chat else "tokens"]) == 9 for c in whole)


def test_stop_strings_wait_for_min_tokens(stack, client, tok):
    """As vLLM: a stop string in the text of the first min_tokens tokens does not end the generation."""
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = full[2:5]  # early in the text: it cuts the output unless min_tokens holds it off
    cut = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    held = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"min_tokens": 12})
    assert held.choices[0].text == full and held.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_logprobs_lists_the_prompt_tokens_first(stack, tok, stream):
    """As vLLM: the prompt's tokens, the first with null, then the generated ones; offsets run over the
    token texts one after the other."""
    body = {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2, "echo": True}
    if stream:
        choices = [c for e in _events(stack, "/v1/completions", body) for c in e["choices"]]
        parts = [c["logprobs"] for c in choices if c["logprobs"] is not None]
        lp = {key: [v for part in parts for v in part[key]] for key in parts[0]}
        text = "".join(c["text"] for c in choices)
    else:
        choice = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10).json()["choices"][0]
        lp, text = choice["logprobs"], choice["text"]
    sent = stack.fake.requests[-1]
    assert (sent.sampling.logprobs, sent.sampling.prompt_logprobs) == (2, 2)
    prompt = list(sent.prompt_token_ids)
    texts, logprobs, _ = _expected(stack, tok, 2)
    prompt_entries = [fake_logprobs(t, 100 + i, 2, vocab_size()) for i, t in enumerate(prompt[1:], 1)]
    prompt_texts = [tok.decode([t], skip_special_tokens=False) for t in prompt]
    assert lp["tokens"] == prompt_texts + texts
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([e.logprob for e in prompt_entries] + logprobs)
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"]) == len(prompt) + 3
    all_texts = prompt_texts + texts
    assert lp["text_offset"] == [sum(len(t) for t in all_texts[:i]) for i in range(len(all_texts))]
    assert text == PROMPT + "".join(texts)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_max_tokens_0_answers_the_prompt_and_its_logprobs_alone(stack, tok, stream):
    """vLLM's log-likelihood request (evaluation harnesses send it): echo with max_tokens 0 is the prompt, its tokens'
    log-probabilities (the first null), nothing generated, finish_reason length — it was refused (max_tokens >= 1)."""
    body = {"prompt": PROMPT, "max_tokens": 0, "logprobs": 1, "echo": True}
    if stream:
        events = _events(stack, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        choices = [c for e in events for c in e["choices"]]
        parts = [c["logprobs"] for c in choices if c["logprobs"] is not None]
        lp = {key: [v for part in parts for v in part[key]] for key in parts[0]}
        text, finish = "".join(c["text"] for c in choices), [c["finish_reason"] for c in choices if c["finish_reason"]]
        usage = next(e["usage"] for e in events if e.get("usage"))
    else:
        answer = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10).json()
        lp, text, finish, usage = (answer["choices"][0]["logprobs"], answer["choices"][0]["text"],
                                   [answer["choices"][0]["finish_reason"]], answer["usage"])
    prompt = list(stack.fake.requests[-1].prompt_token_ids)
    entries = [fake_logprobs(t, 100 + i, 1, vocab_size()) for i, t in enumerate(prompt[1:], 1)]
    assert text == PROMPT and finish == ["length"]
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in prompt]
    assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1:] == pytest.approx([e.logprob for e in entries])
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(prompt)
    r = httpx.post(f"{stack.url}/v1/completions", json={**body, "echo": False}, timeout=10)  # (without echo: refused)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def _vllm_prompt_entries(tok, prompt: list[int], k: int) -> list:
    """vLLM's prompt_logprobs for the fake verifier's prompt scores (token i at position 100 + i)."""
    text = lambda t: tok.decode([t], skip_special_tokens=False)  # noqa: E731
    out = [None]
    for i, t in enumerate(prompt[1:], 1):
        e = fake_logprobs(t, 100 + i, k, vocab_size())
        tops = {tid: (max(v, -9999.0), r + 1) for r, (tid, v) in enumerate(zip(e.top_token_ids, e.top_logprobs))}
        here = {t: tops.get(t, (e.logprob, e.rank)), **tops}
        out.append({str(tid): {"logprob": pytest.approx(v), "rank": rank, "decoded_token": text(tid)}
                    for tid, (v, rank) in here.items()})
    return out


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllms_prompt_logprobs(stack, tok, path):
    """vLLM's prompt_logprobs: N — per prompt token after the first its own and the N most likely, keyed by token id,
    with rank; on each completion choice, on a chat answer; refused streamed, and beside echo's only when they agree."""
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    r = httpx.post(f"{stack.url}{path}", json={**body, "max_tokens": 2, "prompt_logprobs": 2}, timeout=10).json()
    sent = stack.fake.requests[-1]
    assert sent.sampling.prompt_logprobs == 2 and not sent.sampling.HasField("logprobs")
    want = _vllm_prompt_entries(tok, list(sent.prompt_token_ids), 2)
    if path == "/v1/completions":
        assert r["choices"][0]["prompt_logprobs"] == want and r["choices"][0]["logprobs"] is None
    else:
        assert r["prompt_logprobs"] == want and r["choices"][0]["logprobs"] is None
    # N = 0: each prompt token alone, with the rank the verifier counted over the vocabulary (the fake's position % 7
    # + 1 for prompt token i at position 100 + i)
    r = httpx.post(f"{stack.url}{path}", json={**body, "max_tokens": 1, "prompt_logprobs": 0}, timeout=10).json()
    listed = r["choices"][0]["prompt_logprobs"] if path == "/v1/completions" else r["prompt_logprobs"]
    prompt = list(stack.fake.requests[-1].prompt_token_ids)
    assert listed[0] is None and [list(p) for p in listed[1:]] == [[str(t)] for t in prompt[1:]]
    assert [p[str(t)]["rank"] for p, t in zip(listed[1:], prompt[1:])] == [(100 + i) % 7 + 1
                                                                           for i in range(1, len(prompt))]
    streamed = httpx.post(f"{stack.url}{path}", json={**body, "prompt_logprobs": 1, "stream": True}, timeout=10)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    if path == "/v1/completions":
        both = {**body, "max_tokens": 2, "echo": True, "logprobs": 1}
        assert httpx.post(f"{stack.url}{path}", json={**both, "prompt_logprobs": 1}, timeout=10).status_code == 200
        r = httpx.post(f"{stack.url}{path}", json={**both, "prompt_logprobs": 2}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_a_prompt_rank_the_verifier_did_not_count_is_null():
    """rank 0 on the wire (a verifier that counts none) is vLLM's null, not a rank of 0."""
    from gateway.logprobs_shape import vllm_prompt_logprobs
    from tandem.rpc.verifier.v1 import verifier_pb2

    entries = [verifier_pb2.TokenLogprobs(logprob=-2.0), verifier_pb2.TokenLogprobs(logprob=-1.0, rank=4)]
    listed = vllm_prompt_logprobs(str, [7, 8, 9], entries)
    assert listed == [None, {"8": {"logprob": -2.0, "rank": None, "decoded_token": "8"}},
                      {"9": {"logprob": -1.0, "rank": 4, "decoded_token": "9"}}]
