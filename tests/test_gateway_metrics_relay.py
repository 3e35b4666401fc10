"""The gateway's /metrics carries the verifier's metrics (speculation, drafter, KV pages) and the drafter
service's under their own names in one scrape, never a family twice, and says so in tandem:*_metrics_up;
a verifier whose metrics do not answer leaves the gateway's own, promptly, with up = 0."""

from __future__ import annotations

import time

import httpx
import prometheus_client
import pytest
from gateway_harness import MODEL_NAME, Stack, metric_value
from prometheus_client.parser import text_string_to_metric_families

from tandem.service_probe import free_port
from verifier.metrics import VerifierMetrics

GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}


@pytest.fixture(scope="module")
def verifier_metrics():
    vm = VerifierMetrics()
    vm.num_drafts.inc(7)
    vm.accepted_tokens.inc(12)
    vm.accepted_per_pos.labels("0").inc(5)
    vm.drafter_up.set(1)
    vm.kv_pages_free.set(30)
    vm.running.set(4)  # a family the gateway has too (its own view, with model_name)
    vm.accept_length.observe(3)
    port = free_port()
    server, thread = prometheus_client.start_http_server(port, addr="127.0.0.1", registry=vm.registry)
    yield f"http://127.0.0.1:{port}/metrics"
    server.shutdown()
    thread.join(5)


def _type_lines(text: str) -> list[str]:
    return [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]


def test_one_scrape_holds_the_verifiers_speculation_metrics(verifier_metrics):
    s = Stack(verifier_metrics_url=verifier_metrics)
    try:
        assert httpx.post(f"{s.url}/v1/completions", json=GOOD, timeout=10).status_code == 200
        text = httpx.get(f"{s.url}/metrics", timeout=10).text
        assert metric_value(text, "tandem:spec_decode_num_drafts_total") == 7
        assert metric_value(text, "tandem:spec_decode_num_accepted_tokens_total") == 12
        assert metric_value(text, "tandem:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 5
        assert metric_value(text, "tandem:drafter_up") == 1 and metric_value(text, "tandem:kv_pages_free") == 30
        assert metric_value(text, "tandem:spec_decode_accept_length_count") == 1
        assert metric_value(text, "tandem:verifier_metrics_up", model_name=MODEL_NAME) == 1
        assert metric_value(text, "tandem:requests_total", api="completions", status="200") == 1
        # Each family once: the gateway's num_requests_running (with model_name), not the verifier's.
        types = _type_lines(text)
        assert len(types) == len(set(types)), sorted(t for t in types if types.count(t) > 1)
        running = [line for line in text.splitlines() if line.startswith("tandem:num_requests_running")]
        assert running and all("model_name=" in line for line in running), running
        families = {f.name for f in text_string_to_metric_families(text)}  # and the whole text parses
        assert {"tandem:spec_decode_num_drafts", "tandem:requests"} <= families
    finally:
        s.close()


def test_a_verifier_without_metrics_leaves_ours_promptly():
    s = Stack(verifier_metrics_url=f"http://127.0.0.1:{free_port()}/metrics")
    try:
        started = time.monotonic()
        r = httpx.get(f"{s.url}/metrics", timeout=10)
        assert r.status_code == 200 and time.monotonic() - started < 3
        assert metric_value(r.text, "tandem:verifier_metrics_up", model_name=MODEL_NAME) == 0
        assert "tandem:requests" in r.text and "spec_decode" not in r.text
    finally:
        s.close()


def test_without_a_url_there_is_no_relay_and_no_up_sample():
    s = Stack()
    try:
        text = httpx.get(f"{s.url}/metrics", timeout=10).text
        assert not any(line.startswith("tandem:verifier_metrics_up") for line in text.splitlines())
        assert "spec_decode" not in text
    finally:
        s.close()


def test_the_drafter_services_metrics_come_in_the_same_scrape(verifier_metrics):
    from drafter.metrics import DrafterMetrics

    dm = DrafterMetrics()
    dm.rounds.labels("drafts").inc(9)
    dm.verifier_connected.set(1)
    port = free_port()
    server, thread = prometheus_client.start_http_server(port, addr="127.0.0.1", registry=dm.registry)
    s = Stack(verifier_metrics_url=verifier_metrics, drafter_metrics_url=f"http://127.0.0.1:{port}/metrics")
    try:
        text = httpx.get(f"{s.url}/metrics", timeout=10).text
        assert metric_value(text, "tandem:drafter_served_rounds_total", kind="drafts") == 9
        assert metric_value(text, "tandem:drafter_verifier_connected") == 1
        assert metric_value(text, "tandem:spec_decode_num_drafts_total") == 7  # the verifier's beside it
        assert metric_value(text, "tandem:drafter_metrics_up", model_name=MODEL_NAME) == 1
        assert metric_value(text, "tandem:verifier_metrics_up", model_name=MODEL_NAME) == 1
        types = _type_lines(text)
        assert len(types) == len(set(types)), sorted(t for t in types if types.count(t) > 1)
    finally:
        s.close()
        server.shutdown()
        thread.join(5)


def test_a_services_created_samples_of_the_gateways_own_families_are_dropped_too():
    """A service process exposes ``<name>_created`` beside its counters and histograms (the gateway turns them off in
    its own), which the text parser reads as gauge families of their own: those of families the gateway has are
    dropped with them, not left carrying the service's start time beside the gateway's counts."""
    from gateway.metrics_relay import MetricsRelay

    text = """# HELP tandem:prompt_tokens_total Prefilled prompt tokens
# TYPE tandem:prompt_tokens_total counter
tandem:prompt_tokens_total{model_name="m"} 99.0
# HELP tandem:prompt_tokens_created Prefilled prompt tokens
# TYPE tandem:prompt_tokens_created gauge
tandem:prompt_tokens_created{model_name="m"} 1.7e+09
# HELP tandem:time_to_first_token_seconds Time to first token
# TYPE tandem:time_to_first_token_seconds histogram
tandem:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 1.0
tandem:time_to_first_token_seconds_count{model_name="m"} 1.0
tandem:time_to_first_token_seconds_sum{model_name="m"} 0.5
# HELP tandem:time_to_first_token_seconds_created Time to first token
# TYPE tandem:time_to_first_token_seconds_created gauge
tandem:time_to_first_token_seconds_created{model_name="m"} 1.7e+09
# HELP tandem:spec_decode_num_drafts_total Drafts
# TYPE tandem:spec_decode_num_drafts_total counter
tandem:spec_decode_num_drafts_total 7.0
# HELP tandem:spec_decode_num_drafts_created Drafts
# TYPE tandem:spec_decode_num_drafts_created gauge
tandem:spec_decode_num_drafts_created 1.7e+09
"""  # (prometheus_client's text for a service process, which keeps _created samples)
    relay = MetricsRelay("verifier", "http://127.0.0.1:1/metrics", 1.0,
                         {"tandem:prompt_tokens", "tandem:time_to_first_token_seconds"})
    kept = relay._filter(text).decode()
    assert "tandem:prompt_tokens" not in kept and "tandem:time_to_first_token_seconds" not in kept
    assert "tandem:spec_decode_num_drafts_total 7.0" in kept and "tandem:spec_decode_num_drafts_created" in kept


def test_a_hung_service_costs_one_scrape_its_timeout_not_every_scrape(verifier_metrics):
    """A drafter stopped (SIGSTOP) held every scrape for its timeout, the verifier's part fetched after it."""
    import socket

    hung = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    s = Stack(verifier_metrics_url=verifier_metrics,
              drafter_metrics_url=f"http://127.0.0.1:{hung.getsockname()[1]}/metrics")
    try:
        seconds = []
        for _ in range(3):
            started = time.monotonic()
            text = httpx.get(f"{s.url}/metrics", timeout=10).text
            seconds.append(time.monotonic() - started)
            assert metric_value(text, "tandem:drafter_metrics_up", model_name=MODEL_NAME) == 0
            assert metric_value(text, "tandem:verifier_metrics_up", model_name=MODEL_NAME) == 1
            time.sleep(1.2)  # (past the cache of a good answer)
        assert seconds[0] < 3 and max(seconds[1:]) < 0.5, seconds
    finally:
        s.close()
        hung.close()


def test_metrics_can_be_named_as_vllm_names_them(tmp_path):
    """--metrics-prefix vllm: every family of /metrics, the gateway's and the relayed services', is vllm:NAME (vLLM's
    dashboards read them as they are); a label value is not renamed; the default keeps tandem:."""
    from gateway.metrics import with_prefix

    relayed = (b'# HELP tandem:num_requests_running Requests running.\n# TYPE tandem:num_requests_running gauge\n'
               b'tandem:num_requests_running{model_name="tandem:x"} 3.0\n')
    assert with_prefix(relayed, "vllm") == (
        b'# HELP vllm:num_requests_running Requests running.\n# TYPE vllm:num_requests_running gauge\n'
        b'vllm:num_requests_running{model_name="tandem:x"} 3.0\n')
    assert with_prefix(relayed, "tandem") == relayed
    stack = Stack(metrics_prefix="vllm")
    try:
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}
        assert httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30).status_code == 200
        text = httpx.get(f"{stack.url}/metrics", timeout=30).text
        assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
        assert metric_value(text, "vllm:request_success_total", finished_reason="length") == 1
        assert not [line for line in text.splitlines() if "tandem:" in line.split("{")[0]]
    finally:
        stack.close()
