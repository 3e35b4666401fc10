"""The whole stack — drafter, verifier, gateway — over real sockets, driven by the official `openai`
client and by a gRPC client; and one request traced through all three services.

The reference is target-only greedy decoding by the in-process engine on the same weights (checked
against transformers elsewhere), of the same token ids the gateway's tokenizer produces.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from helpers import target_only_greedy
from services import Service, free_port, gateway_service, read_metrics
from tandem.rpc.generation.v1 import generation_pb2 as gen_pb
from tandem.rpc.generation.v1 import generation_pb2_grpc as gen_grpc

pytestmark = pytest.mark.slow
VOCAB = 512


@pytest.fixture(scope="module")
def stack_dirs(tmp_path_factory):
    from checkpoints import write_checkpoint
    from draft_checkpoints import make_draft
    from tandem.training.stdlib_text import train_tokenizer
    from tandem.configs.model import ModelConfig

    root = tmp_path_factory.mktemp("stack")
    target = root / "tiny"
    write_checkpoint(target, "llama", seed=21, num_hidden_layers=6, vocab_size=VOCAB, eos_token_id=1)
    train_tokenizer(target, vocab_size=VOCAB)
    make_draft(root / "draft", ModelConfig.from_dir(target), draft_vocab=128, seed=4)
    return root


def target_only(stack_dirs, prompt_ids: list[int], n: int) -> list[int]:
    """Target-only greedy, stopping at an EOS as the served requests do."""
    return target_only_greedy(stack_dirs / "tiny", [prompt_ids], n, ignore_eos=False, enable_prefix_caching=False)[0]


@pytest.fixture(scope="module")
def stack(stack_dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("stack-logs")
    target, draft = str(stack_dirs / "tiny"), str(stack_dirs / "draft")
    drafter = Service("drafter", ["--model", draft, "--target-model", target], free_port(), logs / "drafter.log").start()
    metrics_port = free_port()
    verifier = Service("verifier", ["--model", target, "--drafter", drafter.address, "--draft-model", draft,
                                    "--metrics-port", str(metrics_port)], free_port(), logs / "verifier.log").start()
    gateway = gateway_service(verifier.address, target, "tiny", logs / "gateway.log").start()
    yield {"drafter": drafter, "verifier": verifier, "gateway": gateway, "metrics_port": metrics_port,
           "url": gateway.url}
    for s in (gateway, verifier, drafter):
        s.stop()


@pytest.fixture(scope="module")
def client(stack):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=stack["url"], api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(stack_dirs):
    from tandem.tokenizer import TextTokenizer

    return TextTokenizer(stack_dirs / "tiny")


def test_completions_stream_and_not_equal_target_only_greedy(stack_dirs, client, tokenizer):
    prompt = "def fibonacci(n):\n    "
    expected = target_only(stack_dirs, tokenizer.encode(prompt), 20)
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    assert full.choices[0].text == tokenizer.decode(expected)
    assert full.usage.completion_tokens == len(expected)
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tokenizer.decode(expected)
    assert chunks[-1].usage.completion_tokens == len(expected)


def test_chat_completions_stream_and_not_equal_target_only_greedy(stack_dirs, client, tokenizer):
    from tandem.chat_template import ChatTemplate

    messages = [{"role": "user", "content": "Write a loop."}]
    rendered = ChatTemplate.from_model_dir(stack_dirs / "tiny").render(messages, add_generation_prompt=True)
    expected = target_only(stack_dirs, tokenizer.encode(rendered), 16)
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert full.choices[0].message.content == tokenizer.decode(expected)
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == tokenizer.decode(expected)


def test_cached_prompt_tokens_are_reported_in_usage(stack_dirs, client, tokenizer):
    """Requests that start with an earlier one's prompt report its full KV pages (16 tokens each) as
    cached, in completions, streamed completions and chat; their text is still target-only greedy."""
    from tandem.chat_template import ChatTemplate

    page = 16
    shared = tokenizer.encode("Tandem serves a target model with an EAGLE-3 head; " * 4)
    assert len(shared) > 2 * page
    first = client.completions.create(model="tiny", prompt=shared + [65], max_tokens=6, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second_ids = shared + [66, 67, 68]
    second = client.completions.create(model="tiny", prompt=second_ids, max_tokens=6, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == len(shared) // page * page
    assert second.choices[0].text == tokenizer.decode(target_only(stack_dirs, second_ids, 6))
    chunks = list(client.completions.create(model="tiny", prompt=shared + [70], max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(shared) // page * page

    system = {"role": "system", "content": "You answer in one short line of Python. " * 4}
    template = ChatTemplate.from_model_dir(stack_dirs / "tiny")
    rendered = [tokenizer.encode(template.render([system, {"role": "user", "content": q}], add_generation_prompt=True))
                for q in ("Sum a list.", "Reverse a string.")]
    common = next(i for i, (a, b) in enumerate(zip(*rendered)) if a != b)
    usages = [client.chat.completions.create(model="tiny", messages=[system, {"role": "user", "content": q}],
                                             max_tokens=4, temperature=0).usage
              for q in ("Sum a list.", "Reverse a string.")]
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert usages[1].prompt_tokens_details.cached_tokens == min(common, len(rendered[1]) - 1) // page * page > 0


def test_public_grpc_stream_gets_the_same_tokens(stack_dirs, stack, tokenizer):
    prompt = "import os\n"
    expected = target_only(stack_dirs, tokenizer.encode(prompt), 12)
    with grpc.insecure_channel(f"127.0.0.1:{stack['gateway'].grpc_port}") as channel:
        stub = gen_grpc.GenerationStub(channel)
        request = gen_pb.GenerateRequest(model="tiny", text=prompt, max_tokens=12, temperature=0.0)
        tokens = [t for message in stub.Generate(request, timeout=60) for t in message.token_ids]
    assert tokens == expected


def test_bad_requests_are_4xx_naming_the_field_and_the_stack_keeps_serving(client):
    import openai

    cases = [(dict(prompt="", max_tokens=4), "prompt"), (dict(prompt="x", max_tokens=0), "max_tokens"),
             (dict(prompt="x", max_tokens=10**7), "max_tokens"), (dict(prompt="x", temperature=-1), "temperature"),
             (dict(prompt="x", top_p=0), "top_p"), (dict(prompt="x " * 700, max_tokens=4), "context")]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", **kwargs)
        assert field in str(err.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_client_disconnect_mid_stream_frees_the_kv(stack):
    import httpx

    body = {"model": "tiny", "prompt": "while True:", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", stack["url"] + "/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data:") for line in got)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = read_metrics(stack["metrics_port"])
        if m["tandem:kv_pages_free"] == m["tandem:kv_pages_capacity"] and m["tandem:num_requests_running"] == 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the disconnected request's KV was not freed")


def test_one_request_is_one_trace_across_gateway_verifier_and_drafter(stack_dirs):
    """All three services in this process, exporting to memory; one completion, one trace id."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from drafter.config import DrafterServiceConfig
    from drafter.serve import serve as serve_drafter
    from gateway.config import GatewayConfig
    from gateway.server import Gateway
    from tandem import tracing
    from tandem.engine.config import EngineConfig
    from tandem.speculative.drafter import DrafterConfig
    from verifier.config import VerifierConfig
    from verifier.serve import serve as serve_verifier

    exporter = InMemorySpanExporter()
    tracing.setup_tracing("tandem-test", exporter=exporter)
    target, draft = str(stack_dirs / "tiny"), str(stack_dirs / "draft")
    d_port, v_port = free_port(), free_port()
    loops = []

    def run_in_thread(coro_factory):
        loop = asyncio.new_event_loop()
        stop = asyncio.Event()
        ready = threading.Event()

        async def main():
            nonlocal stop
            stop = asyncio.Event()
            ready_evt = asyncio.Event()
            task = asyncio.ensure_future(coro_factory(ready_evt, stop))
            await ready_evt.wait()
            ready.set()
            await task

        thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
        thread.start()
        assert ready.wait(120)
        loops.append((loop, lambda: stop, thread))

    run_in_thread(lambda r, s: serve_drafter(DrafterServiceConfig(draft, target, DrafterConfig(), port=d_port), r, s))
    vcfg = VerifierConfig(engine=EngineConfig(model=target), port=v_port, drafter=f"127.0.0.1:{d_port}", draft_model=draft,
                          trace_rounds=True)
    run_in_thread(lambda r, s: serve_verifier(vcfg, r, s))
    gw_loop = asyncio.new_event_loop()
    threading.Thread(target=gw_loop.run_forever, daemon=True).start()
    gateway = Gateway(GatewayConfig(verifier=f"127.0.0.1:{v_port}", model_dir=target, port=0, grpc_port=0,
                                    served_model_name="tiny", health_poll_s=0.1))
    asyncio.run_coroutine_threadsafe(gateway.start(), gw_loop).result(30)
    try:
        import httpx

        deadline = time.monotonic() + 30  # the verifier's drafter connection comes up in the background
        spans = []
        while time.monotonic() < deadline:
            exporter.clear()
            r = httpx.post(f"http://127.0.0.1:{gateway.port}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "for i in", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            spans = exporter.get_finished_spans()
            if any(s.name == "drafter.draft" for s in spans):
                break
            time.sleep(0.3)
        # The verifier ends its request span when its handler finishes, which may be just after the
        # gateway has the last message and has answered.
        settle = time.monotonic() + 5
        while not any(s.name == "verifier.generate" for s in spans) and time.monotonic() < settle:
            time.sleep(0.05)
            spans = exporter.get_finished_spans()
        by_name = {}
        for s in spans:
            by_name.setdefault(s.name, []).append(s)
        root = by_name["gateway.completions"][0]
        trace_id = root.context.trace_id
        request_span = by_name["verifier.generate"][0]
        assert request_span.context.trace_id == trace_id
        assert request_span.end_time <= root.end_time  # (a child outlasting its parent: trace viewers draw overhangs)
        for phase in ("draft", "verify", "accept", "draft_extend"):
            assert by_name.get(phase), f"no {phase} span"
            assert all(s.context.trace_id == trace_id for s in by_name[phase])
            assert all(s.parent.span_id == request_span.context.span_id for s in by_name[phase])
        assert all(s.context.trace_id == trace_id for s in by_name["drafter.draft"])
        verify = by_name["verify"][-1]
        assert "tandem.accept_length" in verify.attributes and "tandem.tokens.new" in verify.attributes
    finally:
        asyncio.run_coroutine_threadsafe(gateway.stop(), gw_loop).result(30)
        for loop, stop, thread in reversed(loops):
            loop.call_soon_threadsafe(stop().set)
            thread.join(30)
