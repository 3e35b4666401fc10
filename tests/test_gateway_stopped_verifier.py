"""A stream whose verifier stops answering mid-answer (SIGSTOP: the host still answers TCP for the process) ends with
a 503 error event the client can retry within ~25 s — the gateway's keepalive pings every 15 s and waits 10 s for an
ack (gateway/upstream.py); gRPC's own ping timeout of 60 s had held it a minute. A real verifier process (the demo
target, on the CPU): the fake one's transport would answer the pings."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from gateway_harness import Stack

from services import Service, free_port
from tandem.training.demo import ensure_demo_target

ENDS_WITHIN_S = 40.0  # (a ping every 15 s, 10 s for its ack: 25 s at most)


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
def test_a_stream_whose_verifier_is_stopped_ends_with_a_retryable_error_in_seconds(tmp_path):
    target = str(ensure_demo_target())
    verifier = Service("verifier", ["--model", target, "--draft-model", "none"], free_port(),
                       tmp_path / "verifier.log").start()
    stack = None
    stopped_at = None
    try:
        stack = Stack(verifier=verifier.address, model_dir=target)
        body = {"model": stack.gateway.cfg.model_name, "prompt": [5, 6, 7], "max_tokens": 200, "stream": True,
                "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=90) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if stopped_at is None:
                        os.kill(verifier.proc.pid, signal.SIGSTOP)
                        stopped_at = time.monotonic()
                    events.append(line.removeprefix("data: "))
        waited = time.monotonic() - stopped_at
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503, events[-3:]
        print(f"ended {waited:.1f} s after the stop")
        assert waited < ENDS_WITHIN_S, waited
    finally:
        if stopped_at is not None:
            os.kill(verifier.proc.pid, signal.SIGCONT)
        if stack is not None:
            stack.close()
        verifier.stop()
