"""The verifier's engine loop: it builds the engine on its own thread, and once an engine error ends it,
every client — running, queued or arriving later — gets an error at once and the service is told."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from tandem.sampling import SamplingParams
from verifier.engine_loop import EngineLoop, EngineStopped, Submission
from verifier.metrics import VerifierMetrics


class BrokenEngine:
    """Takes requests; its first step fails (a CUDA error, a bug)."""

    def __init__(self):
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self.allocator = SimpleNamespace(num_free=8, capacity_pages=8)
        self.proposer, self.requests, self.added = None, {}, []

    def add_request(self, prompt, params, rid, spec):
        self.added.append(rid)

    def has_unfinished(self) -> bool:
        return bool(self.added)

    def step(self):
        raise RuntimeError("device-side assert (injected)")


def submission(rid: str, sink) -> Submission:
    return Submission(rid, [1, 2, 3], SamplingParams(max_new_tokens=4), None, sink)


def test_a_dead_engine_loop_fails_its_clients_and_refuses_new_ones():
    built_on, fatal = [], threading.Event()
    engine = BrokenEngine()

    def build():
        built_on.append(threading.current_thread().name)
        return engine, None, None

    loop = EngineLoop(build, VerifierMetrics(), max_waiting=16, on_fatal=lambda error: fatal.set())
    loop.start()
    assert loop.built.result(10)[0] is engine and built_on == ["engine-loop"]  # built on the thread that steps
    outputs = []
    loop.submit(submission("a", outputs.append)).result(10)
    assert fatal.wait(10) and isinstance(loop.fatal, RuntimeError)
    assert outputs and isinstance(outputs[0], RuntimeError)  # the running request got the error
    with pytest.raises(EngineStopped, match="device-side assert"):
        loop.submit(submission("b", outputs.append)).result(1)  # refused at once, not left waiting
    loop.join(5)
    assert not loop.is_alive()


def test_a_build_that_fails_reaches_the_caller():
    def build():
        raise FileNotFoundError("no model.safetensors in /nowhere")

    loop = EngineLoop(build, VerifierMetrics(), max_waiting=16)
    loop.start()
    with pytest.raises(FileNotFoundError, match="nowhere"):
        loop.built.result(10)
    loop.join(5)
    assert not loop.is_alive()
