"""The verifier's observability as vLLM/SGLang users read it: the periodic stats line, the KV usage,
preemption and prefix-cache metrics (vLLM's names under tandem:), and labels named as the gateway names
them."""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from gateway.metrics import GatewayMetrics
from helpers import random_prompt
from tandem.sampling import SamplingParams
from verifier.engine_api import Submission
from verifier.engine_loop import EngineLoop
from verifier.metrics import VerifierMetrics
from verifier.stats_line import StatsLine

LINE = re.compile(r"Decode batch: running (\d+), waiting (\d+), gen throughput ([\d.]+) tok/s, accept len (\S+), "
                  r"KV usage ([\d.]+)%, preemptions (\d+), (spec .*?)"
                  r"(?:; host ([\d.]+) CPUs \(the engine thread [\d.]+\), (\d+) µs a token)?$")


def test_stats_line_reports_throughput_over_busy_time_and_accept_length():
    cpu, thread = [2.0], [1.0]  # the process's CPU seconds, the engine thread's
    stats = StatsLine(10.0, speculative=True, cpu_clock=lambda: cpu[0], thread_clock=lambda: thread[0])
    cpu[0] += 60.0  # start-up (loading, capture): in no figure
    thread[0] += 50.0
    stats.step(now=100.0, step_s=0.5, tokens=10, rounds=2, accepted=4, speculative=True)
    cpu[0] += 0.25  # the process's CPU over the half second to the next step, the engine thread's 0.1 of it
    thread[0] += 0.1
    stats.step(now=100.5, step_s=0.4, tokens=10, rounds=0, accepted=0, speculative=False)
    cpu[0] += 30.0  # idle CPU (and the step after the pause): left out
    thread[0] += 20.0
    stats.step(now=105.0, step_s=0.5, tokens=10, rounds=0, accepted=0, speculative=False)  # after 4.5 s idle
    assert not stats.due(109.9) and stats.due(110.0)
    stats.preempted(2)
    line = stats.line(running=3, waiting=1, kv_usage=0.125)
    assert line == ("Decode batch: running 3, waiting 1, gen throughput 20.0 tok/s, accept len 3.00, "
                    "KV usage 12.5%, preemptions 2, spec on (33% of steps); host 0.50 CPUs (the engine thread 0.20), "
                    "25000 µs a token")
    assert not stats.due(1e9)  # a new window starts with the next step
    stats.step(now=200.0, step_s=1.0, tokens=5, rounds=0, accepted=0, speculative=False)
    assert "accept len n/a" in stats.line(1, 0, 0.0) and "spec off (the policy" in stats.line(1, 0, 0.0)
    stats.step(now=300.0, step_s=1.0, tokens=5, rounds=0, accepted=0, speculative=False)
    assert "spec off (the drafter is down" in stats.line(1, 0, 0.0, drafter_up=False)
    stats.step(now=350.0, step_s=1.0, tokens=5, rounds=0, accepted=0, speculative=False)
    assert "drafter detached" in stats.line(1, 0, 0.0, detached=True)
    # a step of prompts alone is not a decode step: the share counts the steps that ran the running requests
    stats.step(now=400.0, step_s=0.1, tokens=1, rounds=0, accepted=0, speculative=False, decoded=False)
    stats.step(now=400.1, step_s=0.1, tokens=8, rounds=4, accepted=4, speculative=True)
    assert "spec on (100% of steps)" in stats.line(1, 0, 0.0)
    # the trees' mean size: what the policy drafts (a chain it shortened at batch shows here)
    stats.step(now=500.0, step_s=0.1, tokens=8, rounds=4, accepted=4, speculative=True, drafted=6)
    assert "spec on (100% of steps, 1.5 drafts a round)" in stats.line(1, 0, 0.0)
    # rounds a step: how long the speculative steps' runs of rounds were; overlapped: the runs queued behind the one
    # before (of the runs of several rounds)
    stats.step(now=600.0, step_s=0.1, tokens=8, rounds=4, accepted=4, speculative=True, drafted=12, run=4)
    stats.step(now=600.1, step_s=0.1, tokens=8, rounds=4, accepted=4, speculative=True, drafted=12, run=1)
    assert "spec on (100% of steps, 3.0 drafts a round, 2.5 rounds a step, 0% overlapped)" in stats.line(1, 0, 0.0)
    for k, ahead in enumerate((True, True, True, False)):
        stats.step(now=650.0 + k, step_s=0.1, tokens=8, rounds=4, accepted=4, speculative=True, drafted=12, run=4,
                   queued_ahead=ahead)
    assert "4.0 rounds a step, 75% overlapped)" in stats.line(1, 0, 0.0)
    # plain for: the plain decode steps by the engine's reason, most first; chain switches: the policy's depth changes
    for k, why in enumerate(("exploring", "timing", "exploring", None)):
        stats.step(now=700.0 + k, step_s=0.1, tokens=1, rounds=0, accepted=0, speculative=False, plain_reason=why)
    stats.step(now=704.0, step_s=0.1, tokens=1, rounds=0, accepted=0, speculative=False, decoded=False,
               plain_reason="model")  # (prompts alone: no decode step)
    stats.step(now=705.0, step_s=0.1, tokens=8, rounds=4, accepted=4, speculative=True)
    stats.chain_switched(3)
    # (steps a second apart or more: no span of busy CPU, so no host part)
    assert stats.line(1, 0, 0.0).endswith("spec on (20% of steps; plain for: exploring 2, timing 1; 3 chain switches)")
    off = StatsLine(0.0, speculative=False)
    off.step(now=1.0, step_s=1.0, tokens=1, rounds=0, accepted=0, speculative=False)
    assert not off.due(1e9) and "spec off (no drafter)" in off.line(1, 0, 0.0)


def test_labels_are_named_as_the_gateways():
    gateway, verifier = GatewayMetrics("m"), VerifierMetrics(model_name="m")
    gateway.labels(gateway.request_success, finished_reason="stop").inc()
    for metric in (gateway.prompt_tokens, gateway.generation_tokens, gateway.running):  # labelled: a sample each
        gateway.labels(metric)
    gateway.labels(gateway.ttft).observe(0.1)
    gateway.itl.observe(0.1)  # (a BulkHistogram: its model_name is constant)
    verifier.requests.labels("stop").inc()
    verifier.kv_usage.set(0.25)
    verifier.preemptions.inc(3)

    def label_names(registry):
        return {f.name: {k for s in f.samples for k in s.labels if k not in ("le", "quantile")}
                for f in registry.collect() if f.samples}

    ours, theirs = label_names(verifier.registry), label_names(gateway.registry)
    common = set(ours) & set(theirs)
    assert {"tandem:request_success", "tandem:prompt_tokens", "tandem:generation_tokens", "tandem:num_requests_running",
            "tandem:time_to_first_token_seconds", "tandem:inter_token_latency_seconds"} <= common
    assert {name: ours[name] for name in common} == {name: theirs[name] for name in common}
    sample = verifier.registry.get_sample_value
    assert sample("tandem:request_success_total", {"model_name": "m", "finished_reason": "stop"}) == 1
    assert sample("tandem:kv_cache_usage_perc", {"model_name": "m"}) == 0.25
    assert sample("tandem:num_preemptions_total", {"model_name": "m"}) == 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from checkpoints import write_checkpoint

    root = tmp_path_factory.mktemp("stats")
    write_checkpoint(root / "target", "llama", seed=3, num_hidden_layers=2)
    return root / "target"


def test_a_busy_loop_logs_stats_lines_and_counts_preemptions(target_dir, caplog):
    """Four requests in a 48-token KV cache that need ~100: preempted and recomputed. The counter and the
    lines' preemptions equal the requests' own counts; KV usage is a fraction, back to 0 at the end."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    caplog.set_level(logging.INFO, logger="verifier.stats")
    requests = []

    def build():
        engine = LLMEngine(EngineConfig(model=str(target_dir), kv_pages=13, page_size=4))
        add = engine.add_request

        def recording_add(*args, **kwargs):
            rid = add(*args, **kwargs)
            requests.append(engine.requests[rid])
            return rid
        engine.add_request = recording_add
        return engine, None, None

    metrics = VerifierMetrics(model_name="tiny")
    loop = EngineLoop(build, metrics, max_waiting=16, stats=StatsLine(0.001, speculative=False))
    loop.start()
    loop.built.result(60)
    done = [threading.Event() for _ in range(4)]
    try:
        for i, (length, new) in enumerate(zip([6, 9, 5, 8], [20, 18, 22, 16])):
            sink = (lambda e: lambda out: e.set() if getattr(out, "finish_reason", None) is not None else None)(done[i])
            loop.submit(Submission(f"r{i}", random_prompt(10 + i, length), SamplingParams(max_new_tokens=new,
                                                                                          ignore_eos=True), None, sink))
        assert all(e.wait(60) for e in done)
        time.sleep(0.1)
    finally:
        loop.stop()
        loop.join(10)
        loop.engine.shutdown()
    preempted = sum(r.num_preemptions for r in requests)
    assert preempted > 0, "the cache was small enough to force preemption"
    sample = metrics.registry.get_sample_value
    assert sample("tandem:num_preemptions_total", {"model_name": "tiny"}) == preempted
    assert sample("tandem:kv_cache_usage_perc", {"model_name": "tiny"}) == 0.0
    assert sample("tandem:request_success_total", {"model_name": "tiny", "finished_reason": "length"}) == 4
    # Preempted requests leave their pages cached; recomputed, they look them up (some evicted meanwhile).
    cache = loop.engine.prefix_cache.stats
    assert cache.queries > sum(len(r.prompt) for r in requests) and cache.evictions > 0
    for name, value in (("queries", cache.queries), ("hits", cache.hits), ("evictions", cache.evictions)):
        assert sample(f"tandem:prefix_cache_{name}_total", {"model_name": "tiny"}) == value
    lines = [LINE.search(r.getMessage()) for r in caplog.records if r.name == "verifier.stats"]
    assert lines and all(lines), [r.getMessage() for r in caplog.records]
    assert sum(int(m.group(6)) for m in lines) <= preempted  # the last window may end without a line
    assert any(float(m.group(5)) > 50 for m in lines) and all(0 <= float(m.group(5)) <= 100 for m in lines)
    assert all(m.group(7) == "spec off (no drafter)" and m.group(4) == "n/a" for m in lines)
    assert any(float(m.group(3)) > 0 for m in lines)
    assert all(m.group(8) is not None for m in lines) and any(float(m.group(8)) > 0 for m in lines)  # host CPU
