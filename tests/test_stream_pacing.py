"""Stream pacing: a gateway whose event loop falls behind asks the verifier to send each stream's tokens at most
every so often (gateway/pacing.py, GenerateRequest.message_interval_us), and the verifier does (verifier/server.py):
the same tokens in fewer messages, none sooner than the interval after the one before but the first."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from gateway_harness import MODEL_NAME, Stack

from gateway.pacing import MessagePace, PaceConfig
from services import Service, free_port
from tandem.rpc.verifier.v1 import verifier_pb2 as pb
from tandem.rpc.verifier.v1 import verifier_pb2_grpc as pb_grpc


def _spin(seconds: float) -> None:
    """Work on the CPU for ``seconds`` (a callback that computes)."""
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        pass


def test_the_interval_asked_follows_the_loops_busy_share_and_lag_from_their_floors_to_the_cap():
    pace = MessagePace(PaceConfig(most_s=0.05, busy_floor=0.5, floor_s=0.001, ratio=2.0, window=4))

    def steady(lag_s, busy):
        for _ in range(60):
            pace.observe(lag_s, busy)
        return pace.interval_us()

    assert steady(0.0, 0.0) == 0 and steady(0.0005, 0.45) == 0  # a loop that keeps up asks for nothing
    assert steady(0.004, 0.3) == pytest.approx(8000, rel=0.01)  # behind on a crowded host: by its lag
    assert steady(0.0, 0.75) == pytest.approx(25000, rel=0.01)  # busy: in proportion past the floor
    assert steady(0.004, 0.75) == pytest.approx(25000, rel=0.01)  # the larger of the two
    assert steady(0.2, 1.0) == 50000  # capped
    off = MessagePace(PaceConfig(most_s=0.0))
    for _ in range(50):
        off.observe(0.2, 1.0)
    assert off.interval_us() == 0


def test_the_sampler_measures_a_loop_held_up_by_its_own_work():
    """Callbacks of 6 ms back to back: the loop lags, its thread is on the CPU (less where it shares a core: then the
    lag speaks), and a pace is asked for."""
    async def scenario():
        pace = MessagePace(PaceConfig(sample_every_s=0.002, window=4))
        sampler = asyncio.create_task(pace.run())
        await asyncio.sleep(0.05)
        idle = pace.lag_s
        stop = time.perf_counter() + 0.4
        while time.perf_counter() < stop:  # callbacks of 6 ms each, back to back: a loop behind its work
            _spin(0.006)
            await asyncio.sleep(0)
        busy = pace.lag_s, pace.busy, pace.interval_us()
        sampler.cancel()
        return idle, busy

    idle, (lag_s, busy, interval_us) = asyncio.run(scenario())
    # (relative to the busy loop's: a loaded test machine may hold the idle loop up now and then)
    assert idle < lag_s / 3 and lag_s > 0.003 and busy > 0.2 and interval_us > 0, (idle, lag_s, busy, interval_us)


def test_a_gateway_behind_its_work_asks_for_paced_streams_and_one_that_keeps_up_does_not():
    stack = Stack()
    try:
        prompt = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}

        def ask() -> int:
            assert httpx.post(f"{stack.url}/v1/completions", json=prompt, timeout=30).status_code == 200
            return stack.fake.requests[-1].message_interval_us

        async def hold_up(seconds: float) -> None:  # the gateway's loop busy 6 ms at a time
            stop = time.perf_counter() + seconds
            while time.perf_counter() < stop:
                _spin(0.006)
                await asyncio.sleep(0)

        busy = asyncio.run_coroutine_threadsafe(hold_up(1.5), stack.loop)
        time.sleep(0.8)
        paced = ask()
        busy.result(10)
        assert 2000 <= paced <= 50000, paced
        deadline = time.monotonic() + 10
        while (interval := ask()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert interval == 0
    finally:
        stack.close()


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    from checkpoints import write_checkpoint

    root = tmp_path_factory.mktemp("pacing")
    write_checkpoint(root / "target", "llama", seed=5, num_hidden_layers=2)
    service = Service("verifier", ["--model", str(root / "target")], free_port(), root / "verifier.log").start()
    yield service
    service.stop()


def _stream(address: str, n: int, interval_us: int) -> list[tuple[float, list[int], str]]:
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], message_interval_us=interval_us,
                                     sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True))
        return [(time.perf_counter(), list(m.token_ids), m.finish_reason)
                for m in pb_grpc.VerifierStub(channel).Generate(request, timeout=120)]


def test_a_paced_stream_carries_the_same_tokens_in_messages_an_interval_apart(verifier):
    plain = _stream(verifier.address, 160, 0)
    paced = _stream(verifier.address, 160, 150_000)
    tokens = lambda messages: [t for _, ids, _ in messages for t in ids]  # noqa: E731
    assert tokens(paced) == tokens(plain) and len(tokens(plain)) == 160
    assert paced[-1][2] == "length"
    gaps = [b[0] - a[0] for a, b in zip(paced, paced[1:])]
    # every message after the first waited the interval from the one before (the last only what it had to)
    assert all(g >= 0.1 for g in gaps[:-1]), gaps
    assert len(paced) < len(plain), (len(paced), len(plain))


def test_an_interval_past_a_second_is_refused(verifier):
    with pytest.raises(grpc.RpcError) as e:
        _stream(verifier.address, 4, 1_000_001)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "message_interval_us" in e.value.details()
