"""Bounded work before anything expensive: body size (413, from the header or while a chunked body
arrives) and upload time (408), prompt length before tokenization, stop strings, generations in
flight (429, slots given back however a request ends), /health answered without a call to the
verifier, and chat's default max_tokens (the room the context leaves)."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import httpx
import pytest
from gateway_harness import MODEL_NAME, stack_fixture, wait_until

from gateway.prompt_bound import PromptBound
from gateway.request import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tandem.rpc.generation.v1 import generation_pb2 as gen_pb
from tandem.rpc.generation.v1 import generation_pb2_grpc as gen_grpc

GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}
BODY_LIMIT = 64 << 10
SLOTS = 2


stack = stack_fixture(max_body_bytes=BODY_LIMIT, max_concurrent_requests=SLOTS, max_tokens_limit=400, body_timeout_s=0.5,
                      max_queue_wait_s=0)  # (refused at once at capacity: the queue has its own test)


def _raw_post(port: int, head: bytes, chunks: list[bytes]) -> bytes:
    """Send a request by hand (a body can lie about its length) and return the status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except OSError:  # the server answered and closed before the upload ended
            pass
        return sock.makefile("rb").readline()


def test_a_body_declared_too_large_is_413_before_it_is_sent(stack):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {64 << 20}\r\n\r\n").encode()
    assert b" 413 " in _raw_post(stack.gateway.port, head, [b'{"prompt": "'])  # 64 MiB announced, 12 bytes sent


@pytest.mark.parametrize("path, fields", [
    ("/v1/completions", GOOD), ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "hi"}]}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}), ("/tokenize", {"prompt": "hi"})])
def test_only_json_bodies_are_read_so_no_web_page_can_post_a_simple_request(stack, path, fields):
    import json

    body = json.dumps(fields).encode()
    for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = httpx.post(f"{stack.url}{path}", content=body, headers={"content-type": media}, timeout=10)
        assert r.status_code == 415 and "application/json" in r.text, (media, r.text)
        assert r.json()["error"]["type"] == "UnsupportedMediaTypeError"
    for media in ("application/json; charset=utf-8", "application/vnd.api+json", None):
        r = httpx.post(f"{stack.url}{path}", content=body, headers={"content-type": media} if media else {}, timeout=10)
        assert r.status_code == 200, (media, r.text)


def test_a_browsers_request_from_another_origin_is_refused_whatever_its_body(stack):
    """A page on another site can post a typeless body (a Blob, sendBeacon) without a CORS preflight: the browser then
    names the page's origin. Clients that are not browsers send no Origin; a page of this host (any port), or served
    through proxies that forward the host, is served."""
    import json

    body = json.dumps(GOOD).encode()
    port = stack.gateway.port
    for origin in ("https://evil.example", "null", f"http://127.0.0.2:{port}"):
        r = httpx.post(f"{stack.url}/v1/completions", content=body, headers={"origin": origin}, timeout=10)
        assert r.status_code == 403 and "another web origin" in r.text, (origin, r.text)
        assert r.json()["error"]["type"] == "PermissionDeniedError"
    for headers in ({}, {"origin": f"http://127.0.0.1:{port}"}, {"origin": "http://127.0.0.1:3000"},
                    {"origin": "https://chat.example", "x-forwarded-host": "edge.example, chat.example:8443"}):
        r = httpx.post(f"{stack.url}/v1/completions", content=body, headers=headers, timeout=10)
        assert r.status_code == 200, (headers, r.text)


def test_a_chunked_body_is_cut_off_at_the_limit(stack):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * 8192
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (BODY_LIMIT // len(piece) * 4)
    assert b" 413 " in _raw_post(stack.gateway.port, head, chunks)
    r = httpx.post(f"{stack.url}/v1/completions", content=b"{" + b" " * (BODY_LIMIT + 1) + b"}",
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413 and str(BODY_LIMIT) in r.json()["error"]["message"]
    padded = b'{"prompt": "hi", "max_tokens": 2' + b" " * (BODY_LIMIT - 100) + b"}"  # just under: served
    assert httpx.post(f"{stack.url}/v1/completions", content=padded, timeout=10).status_code == 200


def test_a_body_trickled_too_slowly_is_408_and_never_holds_a_slot(stack):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"prompt\"")  # 11 of 100 bytes, then nothing
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=10) as sock:
        sock.sendall(head)
        time.sleep(0.25)  # (half the module's 0.5 s body timeout: the body is still coming)
        assert stack.gateway.slots.in_use == 0  # slots are taken once a body is in
        assert b" 408 " in sock.makefile("rb").readline()
    assert time.monotonic() - started < 5 and stack.gateway.slots.in_use == 0


def test_bodies_being_received_hold_bounded_memory_together(stack):
    """Slots are taken after a body is read, so bodies in flight are bounded by bytes: connections that sent all but
    the last byte of the largest body fill the budget, the next body is 503 (retryable) until they end (408).
    Announcing a length costs nothing: connections that send headers alone hold none of it."""
    from gateway.admission import BODY_BUDGET_BODIES

    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {BODY_LIMIT}\r\n\r\n").encode()
    announcers = [socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=10)
                  for _ in range(BODY_BUDGET_BODIES * 2)]
    try:
        for sock in announcers:
            sock.sendall(head)
        time.sleep(0.1)
        assert stack.gateway.body_budget.in_use == 0
        assert httpx.post(f"{stack.url}/v1/completions", json=GOOD, timeout=10).status_code == 200
    finally:
        for sock in announcers:
            sock.close()
    holders = [socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=10)
               for _ in range(BODY_BUDGET_BODIES)]
    try:
        for sock in holders:
            sock.sendall(head + b"{" + b" " * (BODY_LIMIT - 2))
        wait_until(lambda: stack.gateway.body_budget.in_use == BODY_BUDGET_BODIES * (BODY_LIMIT - 1), timeout=5)
        r = httpx.post(f"{stack.url}/v1/completions", json=GOOD, timeout=10)
        assert r.status_code == 503 and "request bodies" in r.text and r.headers["retry-after"] == "1", r.text
        assert all(b" 408 " in sock.makefile("rb").readline() for sock in holders)
    finally:
        for sock in holders:
            sock.close()
    assert stack.gateway.body_budget.in_use == 0
    assert httpx.post(f"{stack.url}/v1/completions", json=GOOD, timeout=10).status_code == 200


def test_health_probes_do_not_reach_the_verifier(stack, monkeypatch):
    calls = []
    healthy = stack.gateway.client.healthy
    monkeypatch.setattr(stack.gateway.client, "healthy", lambda: calls.append(1) or healthy())
    time.sleep(0.3)  # the mirror polls every 0.1 s here
    polled, started = len(calls), time.monotonic()
    for _ in range(50):
        assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200
    mirror_polls = (time.monotonic() - started) / stack.gateway.cfg.health_poll_s + 2
    assert len(calls) - polled <= min(mirror_polls, 49)  # the mirror's own polls only, not one per probe


def test_an_obviously_too_long_prompt_is_refused_without_tokenizing(stack, monkeypatch):
    encoded = []
    tok = stack.gateway.tokenizer
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: encoded.append(len(text)) or encode(text, **kw))
    over = stack.gateway.prompt_bound.max_chars(512) + 1  # the fake verifier's context is 512
    r = httpx.post(f"{stack.url}/v1/completions", json={**GOOD, "prompt": "a" * over}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "characters" in r.text
    half = "b" * (over // 2 + 1)  # two messages, each under the bound, together over it
    messages = [{"role": "user", "content": half}, {"role": "user", "content": half}]
    r = httpx.post(f"{stack.url}/v1/chat/completions", json={"messages": messages}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    with grpc.insecure_channel(stack.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as e:
            list(gen_grpc.GenerationStub(channel).Generate(gen_pb.GenerateRequest(text="c" * over, max_tokens=1),
                                                            timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("text")
    for body, param in (({"prompt": "a" * over}, "prompt"), ({"messages": messages}, "messages")):  # /tokenize too
        r = httpx.post(f"{stack.url}/tokenize", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert encoded == []
    assert httpx.post(f"{stack.url}/v1/completions", json=GOOD, timeout=10).status_code == 200
    assert encoded == [len("hello")]


def test_the_prompt_bound_never_refuses_a_prompt_that_fits(stack):
    """Texts as long as they can be while the tokenizer still encodes them within the context — the
    vocabulary's longest token repeated (the worst case), and random tokens — pass the bound."""
    import random

    tok = stack.tok
    bound = PromptBound.of(tok)
    texts = [tok.decode([i]) for i in range(stack.vocab_size)]
    longest = max(texts, key=len)
    rng = random.Random(0)
    for context in (16, 512, 4096):
        for piece in (lambda k: longest * k, lambda k: "".join(rng.choice(texts) for _ in range(k))):
            k = 2 * context
            text = piece(k)
            while len(tok.encode(text)) > context:  # the most copies that still fit, by the tokenizer's count
                k = k * context // len(tok.encode(text)) if k > 1 else 0
                text = piece(k)
            assert text and len(tok.encode(text)) <= context
            bound.check(len(text), context, "prompt")  # raises (400) if the bound refused it


def test_stop_strings_are_bounded_in_number_and_length(stack):
    def post(stop):
        return httpx.post(f"{stack.url}/v1/completions", json={**GOOD, "stop": stop}, timeout=10)

    assert post(["s"] * MAX_STOP_STRINGS).status_code == 200
    assert post("x" * MAX_STOP_CHARS).status_code == 200
    for stop in (["s"] * (MAX_STOP_STRINGS + 1), "x" * (MAX_STOP_CHARS + 1), ["ok", "y" * 10_000]):
        r = post(stop)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


def test_slots_queue_in_order_time_out_and_leave_when_cancelled():
    """gateway/admission.Slots: waiters are served first come first served (a large request ahead is not passed by a
    small one), none takes a slot at once while others wait, a wait past queue_wait_s is a 429 that says so, a
    cancelled wait leaves the line, and what can never fit is a 400 naming n."""
    import asyncio
    import contextlib

    from gateway.admission import Slots
    from gateway.errors import GatewayError

    async def main():
        slots, served = Slots(2, queue_wait_s=0.5), []

        async def waiter(name, n):
            await slots.acquire(n)
            served.append(name)

        await slots.acquire(2)
        first = asyncio.create_task(waiter("a", 2))
        await asyncio.sleep(0)
        second = asyncio.create_task(waiter("b", 1))
        await asyncio.sleep(0)
        assert slots.queued == 2
        with pytest.raises(GatewayError):
            slots.take()  # (gRPC's: refused while others wait)
        slots.give_back(1)  # one free: "a" needs two and is first in line, so "b" waits too
        await asyncio.sleep(0)
        assert served == []
        slots.give_back(1)
        await asyncio.sleep(0)
        assert served == ["a"] and slots.in_use == 2
        slots.give_back(2)
        await asyncio.gather(first, second)
        assert served == ["a", "b"] and slots.in_use == 1 and slots.queued == 0
        await slots.acquire(1)
        with pytest.raises(GatewayError, match=r"waited 0.5 s in the queue\), retry later") as e:
            await slots.acquire(1)
        assert e.value.status == 429 and slots.queued == 0 and slots.in_use == 2
        gone = asyncio.create_task(slots.acquire(1))
        await asyncio.sleep(0)
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        assert slots.queued == 0
        slots.give_back(2)
        with pytest.raises(GatewayError) as e:
            await slots.acquire(3)
        assert e.value.status == 400 and e.value.param == "n" and slots.in_use == 0

    asyncio.run(main())


def test_a_rest_request_at_capacity_waits_for_a_slot_and_is_served():
    """vLLM's and SGLang's servers queue what they cannot run yet (their benchmark clients send every prompt at
    once): a request past --max-concurrent-requests waits in line and is answered when a slot comes back."""
    from gateway_harness import Stack

    s = Stack(max_concurrent_requests=1, max_queue_wait_s=30)
    s.fake.delay_s = 0.05
    try:
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", f"{s.url}/v1/completions", json={**GOOD, "max_tokens": 20, "stream": True}) as held:
            assert held.status_code == 200
            waited = []
            thread = threading.Thread(target=lambda: waited.append(
                httpx.post(f"{s.url}/v1/completions", json=GOOD, timeout=30)))
            thread.start()
            wait_until(lambda: s.gateway.slots.queued == 1, 5, "the second request to wait in line")
            assert not waited
            assert 'tandem:gateway_requests_waiting{model_name="%s"} 1.0' % MODEL_NAME in \
                httpx.get(f"{s.url}/metrics", timeout=10).text
            for _ in held.iter_bytes():  # (the first stream runs to its end, its slot comes back)
                pass
        thread.join(30)
        assert waited[0].status_code == 200, waited[0].text
        wait_until(lambda: s.gateway.slots.in_use == 0 and s.gateway.slots.queued == 0, 5, "the slots to come back")
    finally:
        s.close()


def test_generations_in_flight_are_bounded_and_their_slots_come_back(stack):
    stack.fake.delay_s = 0.2
    slots = stack.gateway.slots
    try:
        clients = [httpx.Client(timeout=30) for _ in range(SLOTS)]
        streams = [c.stream("POST", f"{stack.url}/v1/completions", json={**GOOD, "max_tokens": 40, "stream": True})
                   for c in clients]
        responses = [s.__enter__() for s in streams]
        assert all(r.status_code == 200 for r in responses)
        assert slots.in_use == SLOTS
        r = httpx.post(f"{stack.url}/v1/completions", json=GOOD, timeout=10)
        assert r.status_code == 429 and r.json()["error"]["type"] == "RateLimitError", r.text
        assert r.headers["retry-after"] == "1"  # (clients and proxies back off by it)
        with grpc.insecure_channel(stack.grpc_target) as channel:
            with pytest.raises(grpc.RpcError) as e:
                list(gen_grpc.GenerationStub(channel).Generate(gen_pb.GenerateRequest(text="x", max_tokens=1),
                                                                timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for s, c in zip(streams, clients):  # the clients leave mid-stream
            s.__exit__(None, None, None)
            c.close()
        wait_until(lambda: slots.in_use == 0, 5, "the slots of abandoned streams to come back")
    finally:
        stack.fake.delay_s = 0.0
    results = []

    def one():
        results.append(httpx.post(f"{stack.url}/v1/completions", json=GOOD, timeout=10).status_code)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) <= {200, 429} and 200 in results
    wait_until(lambda: slots.in_use == 0, 5, "every slot to come back")
    for bad in ({"prompt": ""}, {"temperature": -1}, {"model": "other"}):  # refusals give theirs back too
        assert httpx.post(f"{stack.url}/v1/completions", json={**GOOD, **bad}, timeout=10).status_code in (400, 404)
    assert slots.in_use == 0


def test_chat_without_max_tokens_gets_the_room_the_context_leaves(stack):
    messages = [{"role": "user", "content": "hello there"}]
    r = httpx.post(f"{stack.url}/v1/chat/completions", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    sent = stack.fake.requests[-1]
    room = 512 - len(sent.prompt_token_ids)
    assert sent.sampling.max_new_tokens == min(room, 400)  # --max-tokens-limit 400 here
    assert r.json()["usage"]["completion_tokens"] == sent.sampling.max_new_tokens


def test_the_grpc_ports_rpcs_in_progress_are_bounded_before_their_messages_are_read(monkeypatch):
    """The gRPC port's messages arrive whole before a handler (and its slot) runs: what bounds the memory they hold is
    the RPCs in progress, the generations allowed plus gateway.admission.GRPC_EXTRA_RPCS (0 here)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from gateway import admission
    from gateway_harness import Stack

    monkeypatch.setattr(admission, "GRPC_EXTRA_RPCS", 0)
    s = Stack(max_concurrent_requests=SLOTS, max_body_bytes=BODY_LIMIT)
    try:
        with grpc.insecure_channel(s.grpc_target) as channel:
            watches = [health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest()) for _ in range(SLOTS)]
            for w in watches:  # (each held open: its first answer read)
                next(w)
            with pytest.raises(grpc.RpcError) as e:
                list(gen_grpc.GenerationStub(channel).Generate(gen_pb.GenerateRequest(text="x" * 1000, max_tokens=1),
                                                                timeout=10))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
            for w in watches:
                w.cancel()
            wait_until(lambda: _answers(lambda: list(gen_grpc.GenerationStub(channel).Generate(
                gen_pb.GenerateRequest(text="x", max_tokens=1), timeout=10))), 5, "a Generate once the watches ended")
    finally:
        s.close()


def _answers(call) -> bool:
    """Whether ``call()`` went through; False where the port refused it as over its RPCs (any other error raises)."""
    try:
        call()
        return True
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        return False


def test_health_watches_are_bounded_so_that_no_key_holder_locks_the_grpc_port(monkeypatch):
    """Health answers without the API key and a Watch is held open: unbounded, they filled the port's RPCs in progress
    and every call was refused, a keyed Generate and health Check included."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from gateway import admission
    from gateway_harness import Stack

    monkeypatch.setattr(admission, "GRPC_HEALTH_WATCHES", 2)
    s = Stack(api_key="k" * 20)
    try:
        with grpc.insecure_channel(s.grpc_target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watches = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
            for w in watches:
                next(w)
            with pytest.raises(grpc.RpcError) as e:
                next(health.Watch(health_pb2.HealthCheckRequest()))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Check" in e.value.details()
            serving = health_pb2.HealthCheckResponse.SERVING
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == serving
            for w in watches:
                w.cancel()
            wait_until(lambda: _answers(lambda: next(health.Watch(health_pb2.HealthCheckRequest()))), 5,
                       "a watch once the others ended")
    finally:
        s.close()


def test_a_grpc_connection_without_calls_is_closed_after_the_keep_alive():
    """A connection that opens HTTP/2 and then says nothing held a descriptor for ever (enough of them and the process
    accepted nothing, REST included); it goes after --timeout-keep-alive as an idle HTTP connection does."""
    from gateway_harness import Stack

    s = Stack(keep_alive_s=1.0)
    try:
        host, port = s.grpc_target.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            # the HTTP/2 preface and an empty SETTINGS frame, then nothing
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            started = time.monotonic()
            while sock.recv(4096):  # (the server's SETTINGS and, once idle, its GOAWAY; then the close)
                pass
            assert time.monotonic() - started < 8
    finally:
        s.close()


def test_a_malformed_origin_is_a_refusal_not_a_server_error(stack):
    for headers in ({"origin": "http://[::1"}, {"origin": "http://a.example", "x-forwarded-host": "["}):
        r = httpx.post(f"{stack.url}/v1/completions", json=GOOD, headers=headers, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError", (headers, r.text)


def test_a_requests_body_is_not_held_while_it_generates():
    """A 4 MB body of small JSON values parses to ~100 MB of objects; held by its request until the generation ended,
    every request in flight held that much (256 slots: ~25 GB)."""
    import json
    import tracemalloc

    from gateway_harness import Stack

    s = Stack()
    try:
        s.fake.delay_s = 0.4
        body = json.dumps({**GOOD, "max_tokens": 6, "pad": [{}] * 300_000}).encode()
        done = []
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            t = threading.Thread(target=lambda: done.append(httpx.post(
                f"{s.url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30)))
            t.start()
            wait_until(lambda: s.gateway.slots.in_use == 1, 10, "the request to be generating")
            time.sleep(0.5)  # (mid-generation: the body was parsed long ago)
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        t.join(30)
        assert done and done[0].status_code == 200, done
        assert held < 8 << 20, f"{held / 2**20:.0f} MiB held while generating"  # (300k dicts: ~20 MiB)
    finally:
        s.close()
