"""The verifier's engine loop: it builds the engine on its own thread, and once an engine error ends it,
every client — running, queued or arriving later — gets an error at once and the service is told."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from tandem.sampling import SamplingParams
from verifier.engine_api import EngineStopped, Submission
from verifier.engine_loop import EngineLoop
from verifier.metrics import VerifierMetrics


class BrokenEngine:
    """Takes requests; its first step fails (a CUDA error, a bug)."""

    def __init__(self):
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self.allocator = SimpleNamespace(num_free=8, capacity_pages=8)
        self.drafts = SimpleNamespace(detached=False, up=lambda: False, settle=lambda: None)
        self.proposer, self.requests, self.added = None, {}, []

    def add_request(self, prompt, params, rid, spec, cache_salt=""):
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


class IdleEngine(BrokenEngine):
    """Takes requests and finishes nothing (steps return no output)."""

    def step(self):
        return []

    def has_unfinished(self) -> bool:
        return False


def test_a_submission_cancelled_before_the_loop_takes_it_is_dropped_and_the_loop_lives():
    """A client whose RPC ends while its submission waits in the command queue cancels the future; the loop
    then takes the next one normally (it once died setting a result on the cancelled future)."""
    engine, fatal = IdleEngine(), threading.Event()
    loop = EngineLoop(lambda: (engine, None, None), VerifierMetrics(), max_waiting=16, on_fatal=lambda e: fatal.set())
    gone = loop.submit(submission("gone", lambda _: None))  # both queued before the loop runs: the first
    assert gone.cancel()  # cancelled in between, as a client that goes away does
    kept = loop.submit(submission("kept", lambda _: None))
    loop.start()
    assert kept.result(10) == "kept"
    assert engine.added == ["kept"] and not fatal.is_set() and loop.fatal is None
    loop.stop()
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


def test_a_step_with_a_run_of_rounds_counts_every_round_in_the_metrics():
    """A step may hold several speculative rounds queued on the device (--spec-rounds): the metrics
    count each (drafts, accept lengths, accepted positions), not the step as one round."""
    from tandem.engine.step import StepOutput

    metrics = VerifierMetrics()
    loop = EngineLoop(lambda: None, metrics, max_waiting=4, on_fatal=lambda error: None)
    out = StepOutput("a", list(range(8)), None, drafted=9, round_accepts=[2, 0, 3])
    loop._observe(out, submission("a", lambda _: None), now=1.0)
    def sample(name, labels=None):
        return metrics.registry.get_sample_value(name, labels if "spec_decode_num" not in name
                                                 else {"model_name": "", **(labels or {})})

    assert sample("tandem:spec_decode_num_drafts_total") == 3
    assert sample("tandem:spec_decode_num_draft_tokens_total") == 9
    assert sample("tandem:spec_decode_num_accepted_tokens_total") == 5
    assert sample("tandem:spec_decode_accept_length_count") == 3
    assert sample("tandem:spec_decode_accept_length_sum") == 3 + 1 + 4
    per_position = [sample("tandem:spec_decode_num_accepted_tokens_per_pos_total", {"position": str(p)}) for p in range(3)]
    assert per_position == [2, 2, 1]


class CountingLoop:
    """An asyncio loop's call_soon_threadsafe, counted (the hops the engine thread makes to the server's loop)."""

    def __init__(self):
        self.hops = 0

    def call_soon_threadsafe(self, fn, *args):
        self.hops += 1
        fn(*args)


def test_a_steps_outputs_reach_their_streams_in_one_hop_in_order():
    """Eight requests stepping together: a hop per output woke the server's loop eight times a step and held the GIL
    both threads share for each; one hop a step carries them all, each request's outputs in order."""
    from tandem.engine.step import StepOutput
    from tandem.engine.request import FinishReason
    from verifier.engine_api import QueueSink

    class Queue(list):
        put_nowait = list.append

    class Engine(IdleEngine):
        def __init__(self):
            super().__init__()
            self.steps = 0

        def has_unfinished(self) -> bool:
            return bool(self.added)

        def step(self):
            self.steps += 1
            last = self.steps == 3
            outs = [StepOutput(rid, [self.steps], FinishReason.LENGTH if last else None) for rid in self.added]
            if last:
                self.added = []
            return outs

    aio, engine, queues = CountingLoop(), Engine(), {f"r{i}": Queue() for i in range(8)}
    loop = EngineLoop(lambda: (engine, None, None), VerifierMetrics(), max_waiting=16)
    engine.last_step, engine.plain_reason = None, ""
    engine.chain = SimpleNamespace(switches=0)
    engine.prefix_cache = None
    engine.scheduler.preemptions = 0
    for rid, q in queues.items():
        loop.submit(submission(rid, QueueSink(aio, q)))
    loop.start()
    loop.built.result(10)
    for _ in range(500):
        if engine.steps == 3 and all(len(q) == 3 for q in queues.values()):
            break
        threading.Event().wait(0.01)
    loop.stop()
    loop.join(5)
    assert [[o.new_token_ids for o in q] for q in queues.values()] == [[[1], [2], [3]]] * 8
    assert all(q[-1].finish_reason is FinishReason.LENGTH for q in queues.values())
    assert aio.hops == 3  # one a step, not one an output (24)


def test_a_step_whose_bookkeeping_fails_still_delivers_what_it_finished():
    """A step finishes request a and goes on with b, and the metrics' bookkeeping of b's output raises (a bug): the
    loop dies and fails b, and a, no longer running, must still get its last output — delivering a step's outputs
    together at its end once lost it, and its client waited until the server's grace ran out."""
    from tandem.engine.request import FinishReason
    from tandem.engine.step import StepOutput
    from verifier.engine_api import QueueSink

    class Engine(IdleEngine):
        def has_unfinished(self) -> bool:
            return bool(self.added)

        def step(self):
            self.added = []
            return [StepOutput("a", [1], FinishReason.LENGTH), StepOutput("b", [2], None)]

    class Queue(list):
        put_nowait = list.append

    engine, fatal, got = Engine(), threading.Event(), {"a": Queue(), "b": Queue()}
    engine.last_step = None
    metrics = VerifierMetrics()
    loop = EngineLoop(lambda: (engine, None, None), metrics, max_waiting=16, on_fatal=lambda e: fatal.set())
    observe = loop._observe

    def failing(out, sub, now, *tally):
        if out.rid == "b":
            raise RuntimeError("a bookkeeping bug (injected)")
        observe(out, sub, now, *tally)

    loop._observe = failing
    aio = CountingLoop()
    for rid in got:
        loop.submit(submission(rid, QueueSink(aio, got[rid])))  # (as the server's: a step's outputs go together)
    loop.start()
    assert fatal.wait(10)
    loop.join(5)
    assert [o.new_token_ids for o in got["a"]] == [[1]] and got["a"][0].finish_reason is FinishReason.LENGTH
    assert len(got["b"]) == 1 and isinstance(got["b"][0], RuntimeError)
    sample = metrics.registry.get_sample_value
    assert sample("tandem:generation_tokens_total", {"model_name": ""}) == 1  # a's token, counted
    assert sample("tandem:request_success_total", {"model_name": "", "finished_reason": "length"}) == 1


def test_a_steps_tokens_are_counted_before_its_streams_get_them():
    """A client that reads the metrics once its stream ends finds its tokens counted: the step's tally goes into the
    metrics before its outputs are delivered (after, a scrape right after a stream's end missed them)."""
    from tandem.engine.request import FinishReason
    from tandem.engine.step import StepOutput

    class Engine(IdleEngine):
        def has_unfinished(self) -> bool:
            return bool(self.added)

        def step(self):
            self.added = []
            return [StepOutput("a", [1, 2, 3], FinishReason.LENGTH)]

    engine, seen, done = Engine(), [], threading.Event()
    engine.last_step = None
    metrics = VerifierMetrics()
    loop = EngineLoop(lambda: (engine, None, None), metrics, max_waiting=16, on_fatal=lambda e: done.set())

    def sink(out):
        seen.append(metrics.registry.get_sample_value("tandem:generation_tokens_total", {"model_name": ""}))
        done.set()

    loop.submit(submission("a", sink))
    loop.start()
    assert done.wait(10)
    loop.stop()
    assert seen == [3.0]
