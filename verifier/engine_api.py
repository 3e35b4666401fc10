"""What the server and the engine loop pass between them, wherever the loop runs (verifier.engine_loop's thread in the
service's process, or verifier.engine_process's child): a request's ``Submission``, the sinks its outputs go to (a
step's outputs that go the same way delivered in one go), and the errors that end serving."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from tandem.engine.step import StepOutput
from tandem.errors import TandemError
from tandem.sampling import SamplingParams
from tandem.watchdog import ENGINE_FAILED_EXIT_CODE, HUNG_EXIT_CODE


class EngineStopped(RuntimeError):
    """The engine loop died (an engine error): nothing more can be served (UNAVAILABLE)."""

    @classmethod
    def after(cls, error: BaseException) -> "EngineStopped":
        return cls(f"the engine stopped: {error}")


class QueueFull(TandemError):
    """The waiting queue is at its bound (RESOURCE_EXHAUSTED)."""


class EngineHung(EngineStopped):
    """The engine's watchdog found it hung (an engine process's child exited HUNG_EXIT_CODE, its stacks on stderr)."""


class EngineFailed(RuntimeError):
    """Raised by the service once it has drained after its engine loop died (``fatal``): the process exits non-zero
    (``exit_code``: HUNG_EXIT_CODE for a hang, as a hang on the engine's thread exits) so that its supervisor (tandem
    up, compose) starts a fresh one."""

    def __init__(self, fatal: BaseException):
        super().__init__(f"the engine loop failed: {type(fatal).__name__}: {fatal}")
        self.exit_code = HUNG_EXIT_CODE if isinstance(fatal, EngineHung) else ENGINE_FAILED_EXIT_CODE


class BatchedSink:
    """A request's outputs, delivered with the other outputs of a step that go the same way (``hop``) in one go:
    ``deliver(hop, [(target, output), ...])`` (``deliver_outputs``)."""

    hop: Any
    target: Any

    def __call__(self, out: StepOutput | BaseException) -> None:
        type(self).deliver(self.hop, [(self.target, out)])

    @staticmethod
    def deliver(hop, items: list) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class QueueSink(BatchedSink):
    """Outputs into ``target`` (an asyncio.Queue) on ``hop`` (its asyncio loop, on another thread): a step's outputs for
    one loop go in one call_soon_threadsafe, where one an output woke that loop once a request and took both threads'
    time from the GIL they share (~5 µs of the engine thread's a hop)."""

    hop: Any  # asyncio.AbstractEventLoop
    target: Any  # asyncio.Queue

    @staticmethod
    def deliver(loop, items: list) -> None:
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list) -> None:
    for into, out in items:
        into.put_nowait(out)


def deliver_outputs(pairs) -> None:
    """``(sink, output)`` pairs, in order: batched sinks' together by the way they go, the others one by one."""
    hops: dict[tuple, list] = {}
    for sink, out in pairs:
        if isinstance(sink, BatchedSink):
            hops.setdefault((type(sink), sink.hop), []).append((sink.target, out))
        else:
            sink(out)
    for (kind, hop), items in hops.items():
        kind.deliver(hop, items)


@dataclass
class Submission:
    rid: str
    prompt: list[int]
    params: SamplingParams
    spec: Any  # SpecConfig, None (off), or "default"
    sink: Callable[[StepOutput | BaseException], None]  # (a BatchedSink: a step's outputs go together)
    trace_context: Any = None  # the request span's context, parent of its round spans
    cache_salt: str = ""  # (LLMEngine.add_request's)
    added: Future = field(default_factory=Future)
    submitted_at: float = field(default_factory=time.perf_counter)
