"""Pieces of the gateway on their own: incremental detokenization, stop strings, limits, chat
templates, tracing without opentelemetry, and ``python -m gateway`` as a process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from gateway_harness import MODEL_NAME, Stack, tiny_model_dir

from gateway.detokenize import IncrementalDetokenizer, StopStrings
from gateway.errors import GatewayError
from gateway.request import resolve_max_tokens
from tandem.chat_template import ChatTemplate, ChatTemplateError
from tandem.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parent.parent


def test_detokenizer_holds_back_split_characters():
    tok = TextTokenizer(tiny_model_dir())
    text = "naïve café — 日本語 ✓ done"
    ids = tok.encode(text)
    # Byte-level BPE: the multi-byte characters come out as several tokens each.
    detok = IncrementalDetokenizer(tok.decode)
    parts = [detok.add([t]) for t in ids[:-1]] + [detok.add(ids[-1:], final=True)]
    assert "".join(parts) == text
    assert not any("\ufffd" in p for p in parts)


def test_detokenizer_emits_real_replacement_characters_at_the_end():
    tok = TextTokenizer(tiny_model_dir())
    e_acute = tok.encode("é")
    assert len(e_acute) == 2  # two byte tokens
    detok = IncrementalDetokenizer(tok.decode)
    assert detok.add(e_acute[:1]) == ""  # half a character: wait
    assert detok.add([], final=True) == "\ufffd"  # the stream ended on it: it is real


def test_stop_strings_across_deltas():
    s = StopStrings(["STOP", "\n\n"])
    out = [s.feed("hello ST"), s.feed("O"), s.feed("P and more")]
    assert "".join(out) == "hello " and s.hit and s.feed("later") == ""
    s = StopStrings(["abc"])
    assert s.feed("xab") == "x" and s.feed("d") == "abd" and not s.hit
    assert s.feed("ab", final=True) == "ab"
    s = StopStrings(["aab"])
    assert s.feed("aa") == "" and s.feed("ab") == "a" and s.hit
    assert StopStrings([]).feed("anything") == "anything"


def test_max_tokens_resolution():
    assert resolve_max_tokens(None, 10, 100, None, 16) == 16
    assert resolve_max_tokens(None, 90, 100, None, 16) == 10  # the default shrinks to fit
    assert resolve_max_tokens(None, 10, 100, 50, None) == 50  # chat: the room, capped by the limit
    assert resolve_max_tokens(None, 10, 0, None, 16) == 16  # context unknown: the verifier checks
    assert resolve_max_tokens(90, 10, 100, None, 16) == 90
    for args, param in [((91, 10, 100, None, 16), "max_tokens"), ((0, 10, 100, None, 16), "max_tokens"),
                        ((5, 100, 100, None, 16), "prompt"), ((60, 10, 100, 50, 16), "max_tokens")]:
        with pytest.raises(GatewayError) as e:
            resolve_max_tokens(*args)
        assert e.value.status == 400 and e.value.param == param


def test_chat_template_forms(tmp_path):
    import json

    t = ChatTemplate.from_model_dir(tiny_model_dir())
    assert t.render([{"role": "user", "content": "hi"}]) == "<|bos|>user\nhi<|eos|>\n<|bos|>assistant\n"
    assert t.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<|bos|>user\nhi<|eos|>\n"
    assert ChatTemplate.from_model_dir(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"},
        "chat_template": [{"name": "default", "template": "{{ bos_token }}{% for m in messages %}"
                           "{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                           "{{ m | tojson }}{% endfor %}"}]}))
    t = ChatTemplate.from_model_dir(tmp_path)
    assert t.render([{"role": "user", "content": "é"}]) == '<s>{"role": "user", "content": "é"}'
    with pytest.raises(ChatTemplateError, match="no tools"):
        t.render([{"role": "tool", "content": "x"}])
    # A template file wins over the config, and is sandboxed: Python internals stay out of reach.
    (tmp_path / "chat_template.jinja").write_text("[{{ messages[0].content.__class__ }}]")
    assert ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": "x"}]) == "[]"
    (tmp_path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": "x"}])


def test_tracing_is_a_no_op_without_opentelemetry():
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "from tandem import tracing as t\n"
            "assert not t.OTEL_AVAILABLE and t.setup_tracing('x', 'http://collector:4317') is None\n"
            "s = t.start_span('a', parent=t.extract_context([('traceparent', 'x')]), attributes={'k': 1})\n"
            "s.set_attribute('k', 2); s.add_event('e'); t.set_error(s, 'bad'); s.end()\n"
            "with t.use_span(s): assert t.inject_metadata(t.context_with(s)) == [] and t.inject_dict() == {}\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=30)


@pytest.mark.parametrize("env, named", [({}, "tandem-gateway"), ({"OTEL_SERVICE_NAME": "edge-gw"}, "edge-gw"),
                                        ({"OTEL_RESOURCE_ATTRIBUTES": "team=x, service.name=gw-b"}, "gw-b")])
def test_the_standard_variables_name_the_traced_service_where_they_say_one(env, named):
    code = ("from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter\n"
            "from tandem import tracing as t\n"
            "p = t.setup_tracing('tandem-gateway', exporter=InMemorySpanExporter())\n"
            "print(p.resource.attributes['service.name'])\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=30, capture_output=True,
                         text=True, env={**clean, **env}).stdout
    assert out.strip() == named


@pytest.mark.parametrize("endpoint_env", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
def test_spans_go_over_otlp_http_where_the_standard_protocol_variable_says_so(endpoint_env):
    """OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf (collectors on 4318): the spans reach a collector's /v1/traces as
    OTLP protobuf (decoded here with opentelemetry-proto's own message); they were sent over gRPC whatever it said."""
    import http.server
    import threading

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    got = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            got.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = ("from tandem import tracing as t\n"
                "p = t.setup_tracing('tandem-verifier')\n"
                "t.start_span('verifier.generate', attributes={'k': 1}).end()\n"
                "assert p.force_flush(10_000)\n"
                "t.shutdown_tracing()\n")
        clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60,
                       env={**clean, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                            endpoint_env: f"http://127.0.0.1:{server.server_port}"})
    finally:
        server.shutdown()
    (path, body), = got
    spans = [(span.name, {a.key: a.value.int_value for a in span.attributes})
             for rs in ExportTraceServiceRequest.FromString(body).resource_spans
             for ss in rs.scope_spans for span in ss.spans]
    assert path == "/v1/traces" and spans == [("verifier.generate", {"k": 1})]


def test_an_otlp_protocol_without_an_exporter_is_named_and_tracing_stays_off():
    code = ("import logging; logging.basicConfig()\nfrom tandem import tracing as t\n"
            "assert t.setup_tracing('x', 'http://127.0.0.1:9') is None\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60, capture_output=True,
                         text=True, env={**clean, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    assert "OTLP protocol 'http/json' is not one of grpc, http/protobuf" in out.stderr


def test_gateway_imports_no_torch():
    code = "import sys, gateway.__main__, gateway.server; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_python_m_gateway_serves_logs_its_address_and_stops_on_sigterm():
    verifier = Stack()  # only its fake verifier is used; the gateway under test is the subprocess
    try:
        fake_address = verifier.gateway.cfg.verifier
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--verifier", fake_address, "--model-dir", str(tiny_model_dir()),
             "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--served-model-name", MODEL_NAME],
            cwd=ROOT, stderr=subprocess.PIPE, text=True, env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": ""})
        try:
            url = None
            for line in proc.stderr:
                m = re.search(r"OpenAI API at (http://\S+/v1)", line)
                if m:
                    url = m.group(1)
                    break
            assert url, "no start-up line saying where to send requests"
            body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3}
            r = httpx.post(f"{url}/completions", json=body, timeout=10)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        verifier.close()


def test_bad_model_dir_is_one_line_error():
    r = subprocess.run([sys.executable, "-m", "gateway", "--verifier", "127.0.0.1:1", "--model-dir", "/nonexistent"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: --model-dir /nonexistent: no such folder (nor a Hugging Face id, org/name)"]


@pytest.mark.parametrize("choice, says", [("required", 'tool_choice: is "required" but the request has no tools'),
                                          ({"type": "function", "function": {"name": "f"}},
                                           "tool_choice: names a tool but the request has no tools")])
def test_tool_choice_without_tools_says_what_it_asked(choice, says):
    from gateway.chat_request import _tools

    with pytest.raises(GatewayError) as raised:
        _tools({"tool_choice": choice}, False)
    assert raised.value.message == says, raised.value.message


def test_a_verifiers_repeated_failures_are_one_log_line_every_few_seconds(caplog, monkeypatch):
    """A dead verifier failed each request in a line of its own (159 lines in 1.7 s under a light load)."""
    import grpc

    from gateway import errors

    now = [100.0]
    monkeypatch.setattr(errors._failures, "clock", lambda: now[0])
    monkeypatch.setattr(errors._failures, "_last", {})

    def say(code, details):  # the gateway's own path for a verifier's failure
        err = grpc.aio.AioRpcError(getattr(grpc.StatusCode, code), grpc.aio.Metadata(), grpc.aio.Metadata(), details)
        assert errors.from_upstream(err, "127.0.0.1:1").status in (500, 503)

    with caplog.at_level("WARNING", logger="gateway.errors"):
        for step in range(60):  # 6 s of failures, ten a second
            now[0] = 100.0 + step / 10
            say("UNAVAILABLE", "connection refused")
        say("INTERNAL", "boom")  # another kind: said at once
        now[0] += 1.0
        say("UNAVAILABLE", "connection refused (again)")  # held: counted in the next line
    said = [r.getMessage() for r in caplog.records]
    assert said == ["verifier at 127.0.0.1:1 failed a request: UNAVAILABLE: connection refused",
                    "verifier at 127.0.0.1:1 failed a request: UNAVAILABLE: connection refused (and 49 more like it in 5 s)",
                    "verifier at 127.0.0.1:1 failed a request: INTERNAL: boom"], said


def test_opentelemetrys_export_failures_are_one_line_a_minute(caplog):
    """A collector down: the OTLP exporter said a line per failed export in every service (14 in 25 s)."""
    import importlib
    import logging

    from tandem.log_limit import RepeatFilter
    from tandem.tracing import EXPORT_LOGGERS

    for name in EXPORT_LOGGERS:  # (the modules whose loggers these are: a rename upstream would leave the flood)
        importlib.import_module(name)
    now = [0.0]
    logger = logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter.test")
    limited = RepeatFilter(every_s=60.0, clock=lambda: now[0])
    logger.addFilter(limited)
    try:
        with caplog.at_level("WARNING", logger=logger.name):
            for second in range(0, 130, 5):
                now[0] = float(second)
                logger.warning("Transient error %s encountered while exporting span batch", "UNAVAILABLE")
            logger.error("Failed to export span batch")  # another level: said at once
            logger.warning("Failed to export %s, error code: %s", "span batch", "UNAUTHENTICATED")  # another message
    finally:
        logger.removeFilter(limited)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["Transient error UNAVAILABLE encountered while exporting span batch",
                    "Transient error UNAVAILABLE encountered while exporting span batch (and 11 more like it in 60 s)",
                    "Transient error UNAVAILABLE encountered while exporting span batch (and 11 more like it in 60 s)",
                    "Failed to export span batch", "Failed to export span batch, error code: UNAUTHENTICATED"], said
    code = ("import logging\nfrom tandem import tracing as t\nfrom tandem.log_limit import RepeatFilter\n"
            "assert t.setup_tracing('x', 'http://127.0.0.1:9') is not None\n"
            "assert t.setup_tracing('x', 'http://127.0.0.1:9') is not None\n"  # (a second call adds no second filter)
            "assert all([isinstance(f, RepeatFilter) for f in logging.getLogger(n).filters].count(True) == 1\n"
            "           for n in t.EXPORT_LOGGERS)\n"
            "t.shutdown_tracing()\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_a_stream_whose_client_takes_no_bytes_ends_and_gives_its_slots_back():
    """A client that never reads held its concurrency slots for as long as its socket stayed open (256 of them refused
    everyone else). A send that does not complete within the timeout ends the answer as a client gone."""
    import asyncio

    from gateway.openai_shapes import DisconnectAwareStreamingResponse

    async def run():
        closed, left, never = [], [], asyncio.Event()

        async def body():
            while True:
                yield "data: {}\n\n"

        async def send(message):  # (a full socket: flow control waits for a read that never comes)
            await never.wait()

        async def receive():
            await never.wait()

        response = DisconnectAwareStreamingResponse(body(), lambda: closed.append(True), "",
                                                    lambda: left.append(True), media_type="text/event-stream")
        response.send_timeout_s = 0.2
        await asyncio.wait_for(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send), 10)
        return closed, left

    assert asyncio.run(run()) == ([True], [True])


def test_the_gateway_raises_its_open_files_limit_as_far_as_allowed():
    """At a shell's 1024 descriptors a few hundred idle connections left the gateway unable to accept any."""
    script = ("import resource, sys\n"
              "hard = int(sys.argv[1])\n"
              "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
              "from tandem.service_runtime import raise_open_files_limit\n"
              "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)  # (a hard limit below what it wants: up to it)
    out = subprocess.run([sys.executable, "-c", script, str(hard)], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout.split()
    assert out == [str(hard), str(hard)], out
