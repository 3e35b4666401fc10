"""Reading a queued run back waits for that run only (tandem.staging.HostReadback): with runs
overlapped, the next run is queued before the last is read back, and a read-back queued behind it
would wait for both while the device idles at every run boundary, and overlapping runs would gain
nothing. Skipped without a GPU."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_readback_waits_for_its_own_work_not_for_work_queued_after_it():
    from tandem.staging import HostReadback

    x = torch.arange(12, device="cuda").view(3, 4) * 7
    # Every launch below once first: a kernel's first launch loads its module lazily, which can wait for
    # the device (in a fresh process the in-place add waited for the sleep queued before it).
    HostReadback(x).tolist()
    torch.cuda._sleep(1000)
    x.add_(0)
    torch.cuda.Event().record()
    torch.cuda.synchronize()
    readback = HostReadback(x)
    torch.cuda._sleep(500_000_000)  # ~0.25 s of device time queued after the copy
    x.add_(1)  # and a change to the tensor after it
    later = torch.cuda.Event()
    later.record()
    started = time.perf_counter()
    values = readback.tolist()
    waited = time.perf_counter() - started
    later_done = later.query()
    torch.cuda.synchronize()
    assert values == [[7 * (4 * r + c) for c in range(4)] for r in range(3)]
    assert not later_done, f"the read-back waited {waited:.3f} s, for the work queued after it"


def test_pooled_readbacks_keep_their_values_when_the_buffer_is_reused():
    """A read buffer goes back to its shape's pool: the next read-back of that shape reuses it, and neither the
    values already read nor a read-back still in flight see the other's numbers."""
    from tandem.staging import HostReadback

    a = torch.arange(6, device="cuda").view(2, 3)
    first = HostReadback(a)
    in_flight = HostReadback(a * 10)  # (its own buffer: the first is not read yet)
    assert first.tolist() == [[0, 1, 2], [3, 4, 5]]
    torch.cuda._sleep(200_000_000)  # the next copy waits behind this: a reuse that raced would read stale values
    reused = HostReadback(a + 100)
    assert reused._host is not None and in_flight._host is not None and reused._host is not in_flight._host
    assert reused.tolist() == [[100, 101, 102], [103, 104, 105]]
    assert in_flight.tolist() == [[0, 10, 20], [30, 40, 50]]
    assert first.tolist() == [[0, 1, 2], [3, 4, 5]]  # (read before: the same list, whoever has the buffer now)
    pooled = HostReadback._pool[((2, 3), torch.int64, a.device)]
    assert len(pooled) >= 1


def test_overlapped_decode_runs_are_read_back_while_the_next_run_computes(tmp_path, monkeypatch):
    """Batch 1, graphed decode runs of 8 steps: every run read back with one queued after it returns
    before that one has finished on the device (its end delayed on the device by the test), and the
    tokens are one-step decoding's."""
    import tandem.engine.decode_ahead as decode_ahead
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.models.random_checkpoint import LlamaShape, write_random_llama
    from tandem.sampling import SamplingParams

    path = write_random_llama(tmp_path / "t", LlamaShape(
        vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=6, num_heads=8, num_kv_heads=2,
        max_position_embeddings=1024), dtype="bfloat16", seed=3, std=0.05)
    queue, read = decode_ahead.queue_decode_steps, decode_ahead.read_decode_steps
    following_done: list[torch.cuda.Event] = []
    still_running: list[bool] = []

    def queue_and_mark(executor, reqs, steps, after=None, **kw):
        run = queue(executor, reqs, steps, after, **kw)
        if after is not None:
            # The following run made long on the device (a tiny model's steps take less time than the
            # host needs to queue them), so that a read-back queued behind it is seen to wait.
            torch.cuda._sleep(50_000_000)
            following_done.append(torch.cuda.Event())
            following_done[-1].record()
        return run

    def read_and_check(runner, run):
        tokens = read(runner, run)
        if following_done:
            still_running.append(not following_done.pop().query())
        return tokens

    monkeypatch.setattr(decode_ahead, "queue_decode_steps", queue_and_mark)
    monkeypatch.setattr(decode_ahead, "read_decode_steps", read_and_check)
    prompt = torch.randint(0, 4096, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_new_tokens=81, ignore_eos=True)
    outputs = {}
    for steps in (8, 1):
        cfg = EngineConfig(model=str(path), device="cuda", dtype="bfloat16", cuda_graph_max_bs=4,
                           cuda_graph_widths=(1,), page_size=16, kv_pages=256, decode_steps=steps)
        with LLMEngine(cfg) as eng:
            outputs[steps] = eng.generate([prompt], params)[0].output_token_ids
    assert outputs[8] == outputs[1]
    assert len(still_running) >= 8 and all(still_running), still_running
