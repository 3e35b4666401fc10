"""The OpenAI-compatible REST API through the official ``openai`` client, against the fake verifier:
text equals the decode of the tokens the verifier sent, streamed or not; usage; SSE framing;
cancellation on disconnect; /v1/models, /health, /metrics."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from gateway_harness import MODEL_NAME, metric_value, stack_fixture, wait_until

from tandem.chat_template import ChatTemplate


stack = stack_fixture()


PROMPT = "def fibonacci(n):\n    return"


def test_completion_text_is_the_decode_of_the_verifier_tokens(stack, client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40)
    prompt_ids = stack.tok.encode(PROMPT)
    expected = stack.expected(prompt_ids, 40)
    assert list(stack.fake.requests[-1].prompt_token_ids) == prompt_ids
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL_NAME
    assert r.choices[0].text == stack.tok.decode(expected)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (len(prompt_ids), 40, len(prompt_ids) + 40)


@pytest.mark.parametrize("max_tokens", [1, 7, 64])
def test_streamed_text_joins_to_the_whole_text(stack, client, max_tokens):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True}))
    *content, usage_chunk = chunks
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == max_tokens
    assert usage_chunk.usage.total_tokens == whole.usage.total_tokens


def test_sse_framing(stack):
    body = {"model": MODEL_NAME, "prompt": "x = 1", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert "usage" not in payloads[-1]  # no include_usage: no usage key, no usage chunk
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_completion_uses_the_models_chat_template(stack, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30)
    rendered = ChatTemplate.from_model_dir(stack.gateway.cfg.model_dir).render(messages)
    assert rendered.endswith("<|bos|>assistant\n")
    prompt_ids = stack.tok.encode(rendered)
    assert list(stack.fake.requests[-1].prompt_token_ids) == prompt_ids
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == stack.tok.decode(stack.expected(prompt_ids, 30))
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == 30

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_without_max_tokens_uses_the_room_left_in_the_context(stack, client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
    prompt_len = r.usage.prompt_tokens
    assert stack.fake.requests[-1].sampling.max_new_tokens == 512 - prompt_len
    assert r.usage.completion_tokens == 512 - prompt_len


def test_a_completion_takes_max_completion_tokens_without_max_tokens(stack):
    body = {"model": MODEL_NAME, "prompt": [5, 6], "max_completion_tokens": 3}
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert stack.fake.requests[-1].sampling.max_new_tokens == 3
    r = httpx.post(f"{stack.url}/v1/completions", json={**body, "max_tokens": 2}, timeout=10)  # (its own name wins)
    assert stack.fake.requests[-1].sampling.max_new_tokens == 2
    r = httpx.post(f"{stack.url}/v1/completions", json={**body, "max_completion_tokens": 0}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


def test_token_id_prompt_and_sampling_fields_reach_the_verifier(stack, client):
    r = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=4, temperature=0.5, top_p=0.9,
                                  seed=11, extra_body={"top_k": 5, "ignore_eos": True, "stop_token_ids": [2]})
    req = stack.fake.requests[-1]
    assert list(req.prompt_token_ids) == [5, 6, 7]
    s = req.sampling
    assert (s.temperature, s.top_k, s.seed, s.max_new_tokens, s.ignore_eos, list(s.stop_token_ids)) == \
        (0.5, 5, 11, 4, True, [2])
    assert s.top_p == pytest.approx(0.9)
    assert r.choices[0].text == stack.tok.decode(stack.expected([5, 6, 7], 4))
    client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=1)
    assert stack.fake.requests[-1].sampling.temperature == 1.0  # the OpenAI default
    assert not stack.fake.requests[-1].sampling.HasField("seed")


def test_stop_string_cuts_the_text_streamed_or_not(stack, client):
    prompt_ids = [150, 150]  # their continuation lies among merged (multi-character) tokens
    full = stack.tok.decode(stack.expected(prompt_ids, 60))
    start = next(i for i in range(10, len(full)) if full[i:i + 3].isprintable() and "\ufffd" not in full[i:i + 3])
    stop = full[start:start + 3]
    cut = full[:full.find(stop)]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=60, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=60, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    # vLLM's stop_reason: the stop string matched
    assert r.choices[0].model_extra["stop_reason"] == stop and chunks[-1].choices[0].model_extra["stop_reason"] == stop
    assert all(c.choices[0].model_extra["stop_reason"] is None for c in chunks[:-1])


def test_stop_reason_names_the_stop_token_and_is_null_at_the_length_limit(stack, client):
    prompt_ids = [7, 8, 9]
    token = stack.expected(prompt_ids, 5)[3]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=20,
                                  extra_body={"stop_token_ids": [token]})
    assert (r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == ("stop", token)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert (chat.choices[0].finish_reason, chat.choices[0].model_extra["stop_reason"]) == ("length", None)
    body = {"model": MODEL_NAME, "prompt": prompt_ids, "max_tokens": 20, "stop_token_ids": [token], "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as resp:
        chunks = [json.loads(line.removeprefix("data: ")) for line in resp.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[-1]["choices"][0]["stop_reason"] == token
    sglang = httpx.post(f"{stack.url}/generate", json={"input_ids": prompt_ids, "sampling_params": {
        "max_new_tokens": 20, "stop_token_ids": [token]}}, timeout=10).json()
    assert sglang["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}


def test_models_and_health(stack, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{stack.url}/health").status_code == 200


def test_client_disconnect_mid_stream_cancels_the_verifier_call(stack):
    stack.fake.delay_s = 0.05
    try:
        body = {"model": MODEL_NAME, "prompt": "slow", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: ")).removeprefix("data: "))
            # leaving the block closes the connection mid-stream
        wait_until(lambda: first["id"] in stack.fake.cancelled, what="the verifier to see the cancellation")
        assert first["id"] not in stack.fake.finished

        # A non-streamed request whose client gives up before the answer cancels it too.
        n = len(stack.fake.requests)
        # The answer takes 400 × 50 ms; the client waits 2 s, ample for the gateway to forward it on a loaded host.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{stack.url}/v1/completions", json={**body, "stream": False}, timeout=2.0)
        wait_until(lambda: len(stack.fake.requests) > n, what="the verifier to receive the non-streamed request")
        request_id = stack.fake.requests[n].request_id
        wait_until(lambda: request_id in stack.fake.cancelled, what="the non-streamed request's cancellation")
    finally:
        stack.fake.delay_s = 0.0
    assert httpx.get(f"{stack.url}/health").status_code == 200


def test_metrics_move(stack, client):
    before = httpx.get(f"{stack.url}/metrics").text
    for name in ("tandem:requests_total", "tandem:prompt_tokens_total", "tandem:generation_tokens_total",
                 "tandem:time_to_first_token_seconds_bucket", "tandem:inter_token_latency_seconds_bucket",
                 "tandem:e2e_request_latency_seconds_bucket", "tandem:num_requests_running",
                 "tandem:request_success_total"):
        assert name in before, name
    client.completions.create(model=MODEL_NAME, prompt=[9, 9], max_tokens=6)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
    after = httpx.get(f"{stack.url}/metrics").text
    ok = dict(name="tandem:requests_total", api="completions", status="200")
    bad = dict(name="tandem:requests_total", api="completions", status="400")
    assert metric_value(after, **ok) == metric_value(before, **ok) + 1
    assert metric_value(after, **bad) == metric_value(before, **bad) + 1
    assert metric_value(after, "tandem:generation_tokens_total") == metric_value(before, "tandem:generation_tokens_total") + 6
    assert metric_value(after, "tandem:prompt_tokens_total") == metric_value(before, "tandem:prompt_tokens_total") + 2
    ttft = "tandem:time_to_first_token_seconds_count"
    assert metric_value(after, ttft) == metric_value(before, ttft) + 1
    assert metric_value(after, "tandem:inter_token_latency_seconds_count") >= \
        metric_value(before, "tandem:inter_token_latency_seconds_count") + 5
    assert metric_value(after, "tandem:num_requests_running") == 0
    for name, tokens in (("tandem:request_prompt_tokens", 2), ("tandem:request_generation_tokens", 6)):
        assert metric_value(after, f"{name}_count") == metric_value(before, f"{name}_count") + 1
        assert metric_value(after, f"{name}_sum") == metric_value(before, f"{name}_sum") + tokens
        assert metric_value(after, f"{name}_bucket", le="5.0") == metric_value(before, f"{name}_bucket", le="5.0") + \
            (tokens <= 5)
    decode = "tandem:request_decode_time_seconds_count"
    assert metric_value(after, decode) == metric_value(before, decode) + 1


def test_every_series_a_dashboard_reads_is_there_before_the_first_request():
    """A fresh gateway's scrape holds the histograms' buckets, the token counters, the running gauge and every finish
    reason at zero (a dashboard or alert on them sees 0, not "no data")."""
    from gateway.metrics import FINISH_REASONS, GatewayMetrics

    text = GatewayMetrics("m").render().decode()
    for name in ("tandem:time_to_first_token_seconds_bucket", "tandem:inter_token_latency_seconds_bucket",
                 "tandem:e2e_request_latency_seconds_bucket", "tandem:prompt_tokens_total",
                 "tandem:generation_tokens_total", "tandem:num_requests_running", "tandem:request_prompt_tokens_bucket",
                 "tandem:request_generation_tokens_bucket", "tandem:request_decode_time_seconds_bucket"):
        assert any(line.startswith(name + "{") and 'model_name="m"' in line for line in text.splitlines()), name
    for reason in FINISH_REASONS:
        assert f'tandem:request_success_total{{finished_reason="{reason}",model_name="m"}} 0.0' in text, reason
    assert metric_value(text, "tandem:time_to_first_token_seconds_count") == 0


def test_concurrent_streams_each_get_their_own_text(stack):
    import asyncio

    async def one(http: httpx.AsyncClient, i: int) -> tuple[list[int], str]:
        prompt = [10 + i, 20 + i]
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 20 + i, "stream": True}
        text = []
        async with http.stream("POST", f"{stack.url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        return prompt, "".join(text)

    async def main():
        async with httpx.AsyncClient(timeout=20) as http:
            return await asyncio.gather(*(one(http, i) for i in range(16)))

    for i, (prompt, text) in enumerate(asyncio.run(main())):
        assert text == stack.tok.decode(stack.expected(prompt, 20 + i))
