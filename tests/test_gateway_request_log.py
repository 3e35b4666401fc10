"""--log-requests: one line per finished generation with its numbers (level 0), its sampling settings
(level 1), its prompt and output text (level 2) — the tokens and text checked against the response the
client got and the tokenizer's own count; nothing logged without the flag."""

from __future__ import annotations

import logging

import httpx
import pytest
from gateway_harness import Stack, wait_until

PROMPT = "def fibonacci(n):"


def _records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gateway.requests"]


@pytest.mark.parametrize("level", [None, 0, 1, 2])
def test_a_line_per_finished_generation(caplog, level):
    config = {} if level is None else {"log_requests": True, "log_requests_level": level}
    stack = Stack(**config)
    try:
        with caplog.at_level(logging.INFO, logger="gateway.requests"):
            reply = httpx.post(f"{stack.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 6,
                                                                    "temperature": 0.5, "top_k": 7}, timeout=30).json()
            if level is not None:
                wait_until(lambda: _records(caplog), what="the request's log line")
        lines = _records(caplog)
        if level is None:
            assert lines == []
            return
        [line] = lines
        usage, text = reply["usage"], reply["choices"][0]["text"]
        assert usage["prompt_tokens"] == len(stack.tok.encode(PROMPT, add_special_tokens=True))
        assert f" length: prompt {usage['prompt_tokens']} tokens, completion {usage['completion_tokens']} tokens" in line
        assert "ttft " in line and "e2e " in line
        assert ("temperature 0.5, top_p 1, top_k 7, max_tokens 6" in line) == (level >= 1)
        assert (f"output {text!r}" in line and f"prompt {PROMPT!r}" in line) == (level >= 2)
    finally:
        stack.close()


def test_the_level_is_checked():
    from gateway.config import GatewayConfig
    from gateway_harness import tiny_model_dir

    with pytest.raises(ValueError, match="--log-requests-level"):
        GatewayConfig(verifier="127.0.0.1:1", model_dir=str(tiny_model_dir()), log_requests=True, log_requests_level=3)


def test_a_failed_generations_line_says_what_failed(caplog):
    import grpc

    stack = Stack(log_requests=True)
    try:
        stack.fake.fail_with = (grpc.StatusCode.INTERNAL, "kernel fault")
        with caplog.at_level(logging.INFO, logger="gateway.requests"):
            r = httpx.post(f"{stack.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=30)
            wait_until(lambda: _records(caplog), what="the request's log line")
        [line] = _records(caplog)
        assert r.status_code >= 500 and " error: " in line and ", cause verifier INTERNAL: kernel fault" in line, line
    finally:
        stack.close()
