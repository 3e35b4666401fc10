"""SGLang's native API on the gateway (gateway/sglang_api.py), against the fake verifier: /generate with text or
input_ids, one prompt or a batch, n, SGLang's sampling names reaching the verifier as the completion path sends
them, SGLang's answer (text, output_ids, meta_info with its finish_reason objects and the speculation counts its
tests read), streamed with the text so far; errors naming SGLang's fields; /get_model_info."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx
import pytest
from gateway_harness import stack_fixture
from tokenizers import Tokenizer

stack = stack_fixture()
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def ref(stack) -> Tokenizer:
    return Tokenizer.from_file(str(Path(stack.model_dir) / "tokenizer.json"))


def _generate(stack, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.url}/generate", json=body, timeout=10)


def test_a_text_prompt_gets_sglangs_answer(stack, ref):
    ids = ref.encode(PROMPT).ids
    r = _generate(stack, {"text": PROMPT, "sampling_params": {"max_new_tokens": 7, "temperature": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    want = stack.expected(ids, 7)
    assert out["output_ids"] == want and out["text"] == ref.decode(want)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 7}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (len(ids), 7, 0)
    assert meta["e2e_latency"] > 0 and meta["id"] == stack.fake.requests[-1].request_id
    # the fake sent 7 tokens in rounds of 1, 2, 3, 1: four forwards, 1.75 tokens a round
    assert meta["spec_verify_ct"] == 4 and meta["spec_accept_length"] == pytest.approx(7 / 4)


def test_max_new_tokens_0_answers_the_prompt_alone(stack, ref):
    """SGLang takes 0 (a prompt's processing alone): no text, length 0, the prompt counted."""
    for stream in (False, True):
        r = _generate(stack, {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}, "stream": stream})
        assert r.status_code == 200, r.text
        out = json.loads(r.text.split("\n\n")[-3].removeprefix("data: ")) if stream else r.json()
        assert (out["text"], out["output_ids"]) == ("", [])
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ref.encode(PROMPT).ids), 0)
    r = _generate(stack, {"text": PROMPT, "sampling_params": {"max_new_tokens": 0, "min_new_tokens": 3}})
    assert r.status_code == 400 and "max_new_tokens (0)" in r.json()["error"]["message"], r.text


def test_sglangs_sampling_names_reach_the_verifier(stack):
    params = {"max_new_tokens": 5, "min_new_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
              "stop_token_ids": [9], "ignore_eos": True, "sampling_seed": 11, "repetition_penalty": 1.1,
              "spaces_between_special_tokens": True}
    assert _generate(stack, {"input_ids": [5, 6, 7], "sampling_params": params}).status_code == 200
    sent = stack.fake.requests[-1]
    s = sent.sampling
    assert list(sent.prompt_token_ids) == [5, 6, 7]
    assert (s.max_new_tokens, s.min_tokens, s.top_k, s.seed, list(s.stop_token_ids), s.ignore_eos) == (5, 2, 20, 11, [9], True)
    assert (s.temperature, s.top_p, s.min_p, s.repetition_penalty) == pytest.approx((0.7, 0.9, 0.05, 1.1))
    _generate(stack, {"text": PROMPT})
    assert stack.fake.requests[-1].sampling.max_new_tokens == 128  # SGLang's default


def test_sglangs_default_max_new_tokens_is_shortened_to_the_room_left_not_refused(stack):
    """SGLang's 128 is a default: a prompt 10 tokens short of the context (the fake verifier's 512) gets those 10, as
    SGLang and this gateway's completions do with an unset limit; an explicit 128 is still refused there."""
    ids = [5] * (512 - 10)
    r = _generate(stack, {"input_ids": ids, "sampling_params": {"temperature": 0}})
    assert r.status_code == 200, r.text
    assert stack.fake.requests[-1].sampling.max_new_tokens == 10
    r = _generate(stack, {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 128}})
    assert r.status_code == 400 and "lower max_new_tokens to at most 10" in r.json()["error"]["message"], r.text


def test_a_batch_and_n_give_a_list_in_order(stack, ref):
    prompts = [PROMPT, "x = 1"]
    r = _generate(stack, {"text": prompts, "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 0.5}})
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 4
    for i, out in enumerate(outs):
        assert out["output_ids"] == stack.expected(ref.encode(prompts[i // 2]).ids, 3), i
    assert len({o["meta_info"]["id"] for o in outs}) == 4
    by_ids = _generate(stack, {"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": {"max_new_tokens": 2}}).json()
    assert [o["output_ids"] for o in by_ids] == [stack.expected([5, 6], 2), stack.expected([7, 8, 9], 2)]
    for one in ({"text": [PROMPT]}, {"input_ids": [[5, 6]]}):  # a batch of one is a list of one, as SGLang answers
        outs = _generate(stack, {**one, "sampling_params": {"max_new_tokens": 2}}).json()
        assert isinstance(outs, list) and len(outs) == 1, outs


def test_rid_names_the_answers_as_sglang_numbers_them(stack):
    one = _generate(stack, {"text": PROMPT, "rid": "mine", "sampling_params": {"max_new_tokens": 2}}).json()
    assert one["meta_info"]["id"] == "mine"
    assert stack.fake.requests[-1].request_id != "mine"  # (the verifier keeps the server's own id)
    two = _generate(stack, {"text": [PROMPT, "x"], "rid": "b", "sampling_params": {"max_new_tokens": 2, "n": 2}}).json()
    assert [o["meta_info"]["id"] for o in two] == ["b_0", "b_1", "b_2", "b_3"]
    listed = _generate(stack, {"input_ids": [[5], [6]], "rid": ["p", "q"], "sampling_params": {"max_new_tokens": 2}})
    assert [o["meta_info"]["id"] for o in listed.json()] == ["p", "q"]
    with httpx.stream("POST", f"{stack.url}/generate", timeout=10,
                      json={"text": PROMPT, "rid": "s", "stream": True, "sampling_params": {"max_new_tokens": 3}}) as r:
        events = [json.loads(e.removeprefix("data: ")) for e in r.read().decode().split("\n\n") if e
                  and e != "data: [DONE]"]
    assert events and {e["meta_info"]["id"] for e in events} == {"s"}
    for rid, why in ((["p"], "1 ids for 2 answers"), (7, "a string or a list")):
        r = _generate(stack, {"input_ids": [[5], [6]], "rid": rid})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text


def test_streamed_events_hold_the_text_and_ids_so_far_and_end_with_done(stack, ref):
    ids = ref.encode(PROMPT).ids
    with httpx.stream("POST", f"{stack.url}/generate", timeout=10,
                      json={"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 9}}) as r:
        assert r.status_code == 200
        events = [e.removeprefix("data: ") for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    want = stack.expected(ids, 9)
    outputs = [c["output_ids"] for c in chunks]  # the ids so far too, as SGLang streams by default (not incremental)
    assert len(chunks) > 1 and all(b[: len(a)] == a for a, b in zip(outputs, outputs[1:])) and outputs[-1] == want
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == ref.decode(want)
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 9}
    assert "spec_verify_ct" in chunks[-1]["meta_info"] and "index" not in chunks[-1]


@pytest.mark.parametrize("body,param", [
    ({"text": PROMPT, "input_ids": [1, 2]}, "text"),
    ({}, "text"),
    ({"text": ""}, "text"),
    ({"input_ids": [1, 10**9]}, "input_ids"),
    ({"text": PROMPT, "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"text": PROMPT, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": PROMPT, "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
    ({"text": PROMPT, "sampling_params": {"beam_width": 4}}, "sampling_params.beam_width"),
    ({"text": PROMPT, "sampling_params": {"spaces_between_special_tokens": False}},
     "sampling_params.spaces_between_special_tokens"),
    ({"text": PROMPT, "return_logprob": "yes"}, "return_logprob"),
    ({"text": PROMPT, "sampling_params": [1]}, "sampling_params"),
    ({"input_ids": "def f(x):"}, "input_ids"),  # each kind of prompt in its own field, as SGLang checks them
    ({"input_ids": ["a"]}, "input_ids"),
    ({"text": [1, 2, 3]}, "text"),
    ({"text": 5}, "text"),
    ({"text": PROMPT, "stream": "yes"}, "stream"),
    ({"text": PROMPT, "lora_path": "adapter-1"}, "lora_path"),
    ({"text": PROMPT, "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"text": PROMPT, "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"text": PROMPT, "return_logprob": True, "token_ids_logprob": [5]}, "token_ids_logprob"),
])
def test_bad_requests_name_sglangs_field(stack, body, param):
    r = _generate(stack, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_sglangs_own_benchmark_client_is_served(stack):
    """SGLang's bench_serving sends lora_path, logprob_start_len and more at their no-op values (they were refused);
    fields no one here knows are ignored, as vLLM ignores them."""
    body = {"text": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True},
            "stream": False, "lora_path": "", "return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0,
            "return_text_in_logprobs": False, "stream_options": {"include_usage": True}, "frobnicate": 1}
    r = _generate(stack, body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4


def test_a_refusal_names_sglangs_field_in_its_text_too(stack):
    r = _generate(stack, {"text": PROMPT, "sampling_params": {"max_new_tokens": 100000}})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "sampling_params.max_new_tokens", error
    assert "lower max_new_tokens to at most" in error["message"] and "max_tokens" not in \
        error["message"].replace("max_new_tokens", ""), error


def test_model_info(stack):
    r = httpx.get(f"{stack.url}/get_model_info", timeout=10)
    assert r.status_code == 200 and r.json()["is_generation"] is True
    assert {"model_path", "tokenizer_path", "weight_version", "has_image_understanding"} <= set(r.json())


def test_health_generate_generates_a_token(stack):
    before = len(stack.fake.requests)
    assert httpx.get(f"{stack.url}/health_generate", timeout=30).status_code == 200
    sent = stack.fake.requests[before:]
    assert len(sent) == 1 and sent[0].sampling.max_new_tokens == 1
    stack.fake.fail_with = (grpc.StatusCode.INTERNAL, "engine failed")
    assert httpx.get(f"{stack.url}/health_generate", timeout=30).status_code == 503
    assert httpx.get(f"{stack.url}/health_generate", timeout=30).status_code == 200  # (the failure was one call's)


def _sglang_entry(token: int, position: int, top: int, vocab: int, text_of=None) -> tuple[list, list]:
    """What SGLang's meta_info holds for a token the fake verifier scored at ``position``: its [logprob, id, text] and
    its top ``top`` entries (tests/fake_verifier.fake_logprobs)."""
    from fake_verifier import fake_logprobs

    e = fake_logprobs(token, position, top, vocab)
    text = (lambda t: text_of(t) if text_of else None)
    tops = [[max(v, -9999.0), t, text(t)] for t, v in zip(e.top_token_ids, e.top_logprobs)]
    return [pytest.approx(e.logprob), token, text(token)], tops


def test_return_logprob_gives_sglangs_logprob_lists(stack, ref):
    """return_logprob as SGLang answers it: [logprob, token id, text or null] per generated token, the prompt's from
    logprob_start_len (its first entry null, as SGLang pads it; by default the prompt's last token alone), the
    top_logprobs_num most likely per position; streamed events carry them so far; nothing unless asked."""
    ids = ref.encode(PROMPT).ids
    want = stack.expected(ids, 5)
    vocab = stack.fake.vocab_size
    text_of = lambda t: ref.decode([t], skip_special_tokens=False)  # noqa: E731
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 5}, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 1, "return_text_in_logprobs": True}
    meta = _generate(stack, body).json()["meta_info"]
    out = [_sglang_entry(t, i, 2, vocab, text_of) for i, t in enumerate(want)]
    assert meta["output_token_logprobs"] == [entry for entry, _ in out]
    assert meta["output_top_logprobs"] == [tops for _, tops in out]
    prompt = [_sglang_entry(t, 100 + i, 2, vocab, text_of) for i, t in enumerate(ids) if i >= 2]
    assert meta["input_token_logprobs"] == [[None, ids[1], text_of(ids[1])]] + [entry for entry, _ in prompt]
    assert meta["input_top_logprobs"] == [None] + [tops for _, tops in prompt]
    assert stack.fake.requests[-1].sampling.prompt_logprobs == 2
    # the verifier scores the prompt from token 2 on (its prefix cache may hold what comes before)
    assert stack.fake.requests[-1].sampling.prompt_logprobs_from == 2
    # SGLang's default start (-1): the prompt's last token alone, null; the verifier not asked to score the prompt
    meta = _generate(stack, {k: v for k, v in body.items() if k != "logprob_start_len"}).json()["meta_info"]
    assert (meta["input_token_logprobs"], meta["input_top_logprobs"]) == ([[None, ids[-1], text_of(ids[-1])]], [None])
    assert not stack.fake.requests[-1].sampling.HasField("prompt_logprobs")
    r = _generate(stack, {**body, "logprob_start_len": len(ids)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len", r.text
    # from the prompt's start: its first token has no log-probability; no text unless asked; no tops with N = 0
    meta = _generate(stack, {**body, "logprob_start_len": 0, "top_logprobs_num": 0,
                             "return_text_in_logprobs": False}).json()["meta_info"]
    assert meta["input_token_logprobs"][:2] == [[None, ids[0], None], [pytest.approx(-(100 + 1 + 1) / 10), ids[1], None]]
    assert stack.fake.requests[-1].sampling.prompt_logprobs_from == 1
    assert len(meta["input_token_logprobs"]) == len(ids)
    assert meta["output_token_logprobs"][0][2] is None and "output_top_logprobs" not in meta
    # streamed: each event's lists so far, the last one's as the whole answer's
    events = [json.loads(e.removeprefix("data: ")) for e in _generate(stack, {**body, "stream": True}).text.split("\n\n")
              if e.startswith("data: {")]
    whole = _generate(stack, body).json()["meta_info"]
    assert [len(e["meta_info"]["output_token_logprobs"]) for e in events] == [len(e["output_ids"]) for e in events]
    last = events[-1]["meta_info"]
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"):
        assert last[key] == whole[key], key
    plain = _generate(stack, {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}).json()["meta_info"]
    assert not any("logprobs" in key for key in plain)


def test_the_prompt_is_scored_only_where_asked(stack, ref):
    """A start at the prompt's last token asks the verifier for no prompt entry (the answer: that token, null); in a
    batch where one prompt asks from its start and the other asks nothing, the other is not scored; a verifier from
    before prompt_logprobs_from (every prompt token scored) is read the same."""
    ids = ref.encode(PROMPT).ids
    for stream in (False, True):
        r = _generate(stack, {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                              "logprob_start_len": len(ids) - 1, "stream": stream})
        assert r.status_code == 200, r.text
        assert stack.fake.requests[-1].sampling.prompt_logprobs_from == len(ids)
    assert r.text.count("input_token_logprobs") >= 1 and "null" in r.text
    meta = _generate(stack, {"text": [PROMPT, PROMPT + " return"], "sampling_params": {"max_new_tokens": 2},
                             "return_logprob": [True, False], "logprob_start_len": [0, -1]}).json()
    sent = {len(r.prompt_token_ids): r.sampling.prompt_logprobs_from for r in stack.fake.requests[-2:]}
    other = len(ref.encode(PROMPT + " return").ids)
    assert sent == {len(ids): 1, other: other}
    assert len(meta[0]["meta_info"]["input_token_logprobs"]) == len(ids)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True, "logprob_start_len": 2}
    want = _generate(stack, body).json()["meta_info"]["input_token_logprobs"]
    stack.fake.scores_from = False
    try:
        assert _generate(stack, body).json()["meta_info"]["input_token_logprobs"] == want
    finally:
        stack.fake.scores_from = True


def test_a_prompt_is_scored_with_max_new_tokens_0(stack, ref):
    """(The evaluation and RL use: the prompt's log-probabilities alone.)"""
    ids = ref.encode(PROMPT).ids
    out = _generate(stack, {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                            "logprob_start_len": 0}).json()
    meta = out["meta_info"]
    assert (out["output_ids"], meta["output_token_logprobs"]) == ([], [])
    assert [lp for lp, _, _ in meta["input_token_logprobs"]] == [None] + [
        pytest.approx(-(100 + i + 1) / 10) for i in range(1, len(ids))]


def test_logprob_settings_may_differ_by_prompt_in_a_batch(stack, ref):
    """As SGLang takes them: return_logprob, top_logprobs_num and logprob_start_len one value for all or one per
    prompt; each answer shows what its prompt asked for (the verifier computes the most any asked)."""
    prompts = [PROMPT, "import os\n", "x = 1"]
    body = {"text": prompts, "sampling_params": {"max_new_tokens": 3}, "return_logprob": [True, True, False],
            "top_logprobs_num": [2, 0, 0], "logprob_start_len": [0, -1, 0]}
    answers = _generate(stack, body).json()
    sent = stack.fake.requests[-3:]
    assert [s.sampling.logprobs for s in sent] == [2, 2, 2] and all(s.sampling.prompt_logprobs == 2 for s in sent)
    first, second, third = (a["meta_info"] for a in answers)
    assert [len(t) for t in first["output_top_logprobs"]] == [2, 2, 2]
    assert len(first["input_token_logprobs"]) == len(ref.encode(PROMPT).ids) and first["input_token_logprobs"][0][0] is None
    ids = ref.encode("import os\n").ids
    assert second["input_token_logprobs"] == [[None, ids[-1], None]] and "output_top_logprobs" not in second
    assert len(second["output_token_logprobs"]) == 3
    assert not any("logprobs" in key for key in third)
    r = _generate(stack, {**body, "top_logprobs_num": [1, 2]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs_num" and "2 values for 3" in r.text
    one = _generate(stack, {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                            "logprob_start_len": [0]}).json()["meta_info"]  # (a one-prompt list, for one prompt)
    assert one["input_token_logprobs"][0] == [None, ref.encode(PROMPT).ids[0], None]
