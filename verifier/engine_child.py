"""The engine process's own side (verifier.engine_process starts it with ``spawn``): the engine loop, its metrics and
spans, and the commands the server sends until it says stop or its end of the pipe closes; each step's outputs go back
in one message, each submission's acceptance or refusal, and the end."""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import pickle
import signal
import sys
import threading

from tandem.engine.step import StepOutput
from verifier.engine_api import BatchedSink, Submission

log = logging.getLogger("verifier.engine_process")


class _Outbox:
    """The child's end of the events pipe: one writer at a time (the engine loop's thread, the command reader); and
    the submissions the engine loop may still answer, by number (those a cancellation may name)."""

    def __init__(self, events):
        self.events, self.lock = events, threading.Lock()
        self.live: dict[int, Submission] = {}

    def send(self, message) -> None:
        with self.lock:
            try:
                self.events.send(message)
            except (OSError, ValueError):  # the server is gone; the commands' end tells the child to stop
                pass


# A StepOutput crosses the pipe as the tuple of its fields: pickled as a dataclass, a step's 8 outputs took 11 µs of the
# engine thread on the CPU VM (the class and every field's name each time), as tuples 5
_OUTPUT_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(StepOutput)))


class _PipeSink(BatchedSink):
    """A submission's outputs, a step's together in one message to the server's process."""

    def __init__(self, outbox: _Outbox, number: int):
        self.hop, self.target = outbox, number

    @staticmethod
    def deliver(outbox: _Outbox, items: list) -> None:
        if isinstance(items[-1][1], BaseException):  # the loop died: its end goes once, as "fatal"
            return
        for number, out in items:
            if out.finish_reason is not None:
                outbox.live.pop(number, None)
        outbox.send(("outputs", [(number, _OUTPUT_FIELDS(out)) for number, out in items]))


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - an exception whose arguments do not travel goes as its text
        return RuntimeError(f"{type(error).__name__}: {error}")


def engine_process_main(cfg, build, log_level: int, commands, events) -> None:
    """The engine process: the loop, its metrics and spans; commands until told to stop or the server's end closes.
    Ends with ``os._exit``: multiprocessing's exit would wait, without end, for TP ranks a failed start left."""
    from tandem import args as shared
    from tandem import tracing
    from tandem.parent_death import signal_on_parent_death

    # A terminal's Ctrl-C (or a supervisor's SIGTERM to the whole group) reaches this process too: the server's drain
    # decides when the engine stops ("stop", or the pipe's end), not the signal, which would cut the streams short
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    signal_on_parent_death(signal.SIGKILL)  # while loading (minutes for a large model), nothing reads the pipe
    logging.basicConfig(level=log_level, format=shared.LOG_FORMAT)
    tracing.setup_tracing("tandem-verifier", cfg.otlp_endpoint)
    code = 1
    try:
        code = _serve_commands(cfg, build, commands, _Outbox(events))
    except BaseException:  # noqa: BLE001 - said, then the server sees the pipe end
        log.exception("the engine process failed")
    finally:
        try:
            tracing.shutdown_tracing()
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve_commands(cfg, build, commands, outbox: _Outbox) -> int:
    """Build and run the engine loop, then take its commands; → the process's exit code."""
    from tandem.errors import TandemError
    from tandem.parent_death import signal_on_parent_death
    from tandem import tracing
    from verifier.engine_build import take_down
    from verifier.engine_loop import EngineLoop
    from verifier.metrics import VerifierMetrics
    from verifier.stats_line import StatsLine

    metrics = VerifierMetrics(max_positions=cfg.num_draft_tokens, model_name=cfg.model_name)
    if cfg.metrics_port is not None:
        metrics.serve(cfg.metrics_port, cfg.host)
    loop = EngineLoop(lambda: build(cfg, metrics), metrics, cfg.max_waiting,
                      lambda error: outbox.send(("fatal", _picklable(error))),
                      StatsLine(cfg.log_stats_interval_s, speculative=cfg.drafter is not None), cfg.trace_rounds)
    loop.start()
    try:
        built = loop.built.result()
    except BaseException as e:  # noqa: BLE001 - the server raises it (build_engine took down what it had started)
        if not isinstance(e, TandemError):  # (a bad flag or folder is one line; anything else keeps its traceback)
            log.error("the engine's start failed", exc_info=e)
        outbox.send(("build_failed", _picklable(e)))
        return 1
    signal_on_parent_death(0)  # from now on the pipe's end stops it in order
    outbox.send(("built",))
    live = outbox.live
    try:
        while True:
            try:
                message = commands.recv()
            except (EOFError, OSError):  # the server's process is gone
                break
            kind = message[0]
            if kind == "add":
                number, rid, prompt, params, spec, carrier, salt, submitted_at = message[1:]
                sub = live[number] = Submission(rid, prompt, params, spec, _PipeSink(outbox, number),
                                                trace_context=tracing.extract(carrier) if carrier else None,
                                                cache_salt=salt, submitted_at=submitted_at)

                def added(future, number=number):
                    error = future.exception()
                    if error is not None:
                        live.pop(number, None)
                    outbox.send(("added", number, None if error is None else _picklable(error)))

                # (before it is queued: the engine thread answers it before the step that gives its first outputs)
                sub.added.add_done_callback(added)
                loop.submit(sub)
            elif kind == "cancel":  # (number 0: whichever runs under the id; a submission over: nothing to cancel)
                rid, number = message[1:]
                sub = live.pop(number, None)
                if number == 0 or sub is not None:
                    loop.cancel(rid, sub)
            elif kind == "stop":
                break
    finally:
        loop.stop()
        loop.join(timeout=10)
        take_down(built, stepping=loop.is_alive())
    if loop.fatal is not None:
        return 1
    outbox.send(("stopped",))
    return 0
