"""EngineProcess: the engine loop in a process of its own (``--engine-process``), as vLLM's EngineCore and SGLang's
scheduler run apart from their front ends.

In one process the gRPC front (the asyncio loop: every request's stream, a message each step) and the engine loop's
thread (the host's half of every step) take turns at one GIL: under load the front's work is taken out of the engine's
steps (bench/verifier_front.py). Here the engine loop (verifier/engine_loop.py, unchanged) runs in a child process
with the engine, the drafter's side, the metrics (and their port) and its round spans; this process keeps the
server. They talk through two pipes: requests and cancellations one way; the other way each step's outputs in one
message, each submission's acceptance or refusal, and the end (an engine failure, or the child's exit). Submissions
are numbered here, so a cancellation reaches only the submission it names (as ``EngineLoop.cancel`` with ``sub``).

The child (verifier/engine_child.py) is started with ``spawn`` (CUDA and the TP ranks are started there, never in this process); it ends when
told, or when this process goes (the pipe closes), taking its engine down as the service does.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import queue
import threading
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler
from typing import Callable

from tandem.engine.step import StepOutput
from tandem.watchdog import HUNG_EXIT_CODE
from verifier.engine_child import engine_process_main
from verifier.engine_api import EngineHung, EngineStopped, Submission, deliver_outputs

log = logging.getLogger("verifier.engine_process")


class EngineProcess:
    """The engine loop's interface to the server (``submit``, ``cancel``, ``stop``, ``join``, ``built``, ``fatal``)
    over a child process that runs ``build(cfg, metrics)`` and the loop."""

    def __init__(self, cfg, on_fatal: Callable[[BaseException], None] = lambda error: None, build=None):
        """``build``: a module-level function ``(cfg, metrics) -> (engine, client, ring)`` the child can import
        (default: verifier.engine_build.build_engine)."""
        from verifier.engine_build import build_engine

        self.cfg, self.on_fatal, self._build = cfg, on_fatal, build or build_engine
        self.built: Future = Future()  # None once the child serves (what it built stays there)
        self.fatal: BaseException | None = None
        self._subs: dict[int, Submission] = {}  # number -> the submission, until its last output or its refusal
        self._cancelled: set[int] = set()  # numbers cancelled before the child's answer to them came
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()  # the submissions' books: a submission reaches a live child or fails at once
        # Commands go to the child from a thread of their own, in the order given: a long prompt's write waits on the
        # child's reader, which shares the child's GIL with the engine loop (a 100k-token prompt held the caller, the
        # server's event loop and every stream on it, ~27 ms on the CPU VM against a child busy in Python)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._process = self._commands = self._reader = self._writer = None

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        commands_in, self._commands = ctx.Pipe(duplex=False)
        events, events_out = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=engine_process_main, name="verifier-engine", daemon=False,
                                    args=(self.cfg, self._build, logging.getLogger().level, commands_in, events_out))
        self._process.start()
        commands_in.close()
        events_out.close()
        self._reader = threading.Thread(target=self._read, args=(events,), name="engine-events", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="engine-commands", daemon=True)
        self._writer.start()

    # -- the server's side (any thread) -----------------------------------------------------------
    def submit(self, sub: Submission) -> Future:
        with self._lock:
            if self.fatal is not None:
                sub.added.set_exception(EngineStopped.after(self.fatal))
                return sub.added
            number = next(self._numbers)
            self._subs[number] = sub  # (an end of the child from here on fails it: _fail)
        self._send(("add", number, sub.rid, sub.prompt, sub.params, sub.spec, _carrier(sub.trace_context),
                    sub.cache_salt, sub.submitted_at))
        return sub.added

    def cancel(self, rid: str, sub: Submission | None = None) -> None:
        with self._lock:
            number = next((n for n, s in self._subs.items() if s is sub), None) if sub is not None else 0
            if number is None:  # (a submission already over has nothing to cancel)
                return
            if sub is None or sub.added.done():  # (what still comes for it has no reader: dropped)
                self._subs.pop(number, None)
            else:  # its answer is still to come (as on a thread, added, then cancelled): forgotten then
                self._cancelled.add(number)
        self._send(("cancel", rid, number))

    def stop(self) -> None:
        self._stopping = True
        self._send(("stop",))

    def join(self, timeout: float | None = None) -> None:
        """Wait for the child's end; past ``timeout`` it is killed (its exit must never hang this process's)."""
        if self._process is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                if timeout:
                    log.warning("the engine process did not end within %.0f s; killing it", timeout)
                self._process.kill()
                self._process.join(10)
        if self._reader is not None:
            self._reader.join(1.0)
        if self._writer is not None:
            self._outbox.put(None)  # (after the child's end: nothing more is written)
            self._writer.join(1.0)
        if self._commands is not None and not self.is_alive():
            self._commands.close()

    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def _send(self, message) -> None:
        self._outbox.put(message)

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:  # (Connection.send's two halves: a message that does not pickle is refused, nothing written)
                data = ForkingPickler.dumps(message)
            except Exception as e:  # noqa: BLE001 - whatever the pickler raises
                if message[0] == "add":
                    self._added(message[1], e)
                else:
                    log.exception("an engine command could not be sent: %s", message[0])
                continue
            try:
                self._commands.send_bytes(data)
            except (OSError, ValueError):  # the child is gone (or joined: the pipe closed): its end came by the reader
                pass

    # -- the reader thread ------------------------------------------------------------------------
    def _read(self, events) -> None:
        try:
            self._read_events(events)
        finally:
            events.close()

    def _read_events(self, events) -> None:
        while True:
            try:
                message = events.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "outputs":
                self._outputs(message[1])
            elif kind == "added":
                self._added(*message[1:])
            elif kind == "built":
                self.built.set_result(None)
            elif kind == "build_failed":  # (the server raises it; the child then ends, as a failed load's thread does)
                self.built.set_exception(message[1])
                return
            elif kind == "fatal":  # (read on to the end: refusals of what was in flight still come)
                self._fail(message[1])
        if self.fatal is None and not self._stopping:  # the child died (killed, a crash): its exit code says how
            self._process.join(30)
            self._fail(_child_ended(self._process.exitcode))

    def _outputs(self, items: list) -> None:
        pairs = []
        with self._lock:
            for number, fields in items:
                sub = self._subs.get(number)
                if sub is None:
                    continue
                out = StepOutput(*fields)
                if out.finish_reason is not None:
                    del self._subs[number]
                pairs.append((sub.sink, out))
        deliver_outputs(pairs)

    def _added(self, number: int, error: BaseException | None) -> None:
        with self._lock:  # (settled under the books' lock: a cancel sees it pending or done, never in between)
            sub = self._subs.get(number)
            if sub is None:
                return
            if error is not None or number in self._cancelled:
                del self._subs[number]
                self._cancelled.discard(number)
            if not sub.added.set_running_or_notify_cancel():  # (its caller gave up: its cancel follows)
                return
            if error is None:
                sub.added.set_result(sub.rid)
            else:
                sub.added.set_exception(error)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self.fatal = error
            subs, self._subs = list(self._subs.values()), {}
            self._cancelled.clear()
        if not self.built.done():
            self.built.set_exception(error)
        for sub in subs:  # running: the error ends its stream; waiting to be added: refused (a caller gone: nothing)
            if sub.added.done():
                sub.sink(error)
            elif sub.added.set_running_or_notify_cancel():
                sub.added.set_exception(EngineStopped.after(error))
        self.on_fatal(error)


def _child_ended(code: int | None) -> EngineStopped:
    """The failure a child's unasked end stands for: a hang its watchdog caught (the server then exits as hung too:
    EngineFailed), or any other end."""
    if code == HUNG_EXIT_CODE:
        return EngineHung(f"the engine process hung (its watchdog ended it, exit code {code})")
    return EngineStopped(f"the engine process ended (exit code {code})")


def _carrier(context) -> dict[str, str] | None:
    if context is None:
        return None
    from tandem import tracing

    return tracing.inject_dict(context) or None
