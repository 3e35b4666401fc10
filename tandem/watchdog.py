"""Watchdog: a deadline around a step that may hang (graph capture, first replay, a collective).

A step that outlives its deadline is reported — which step, with the stacks of every thread — the
service's health is flipped to NOT_SERVING through a callback, and the process exits non-zero so a
supervisor restarts it. A hung CUDA graph or NCCL call cannot be interrupted from Python, so
exiting is the only honest recovery; the report is what makes the hang diagnosable.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Callable

log = logging.getLogger("tandem.watchdog")
HUNG_EXIT_CODE = 75
ENGINE_FAILED_EXIT_CODE = 3  # the engine cannot go on (its loop died, a tensor-parallel rank was lost): restart it
_HANG_HOOKS: list[Callable[[str], None]] = []


def on_any_hang(hook: Callable[[str], None]) -> None:
    """Register a process-wide hook every watchdog runs before exiting (a service flips its gRPC health
    to NOT_SERVING here, without the engine and graph code having to know about gRPC)."""
    _HANG_HOOKS.append(hook)


def all_thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watchdog:
    def __init__(self, on_hang: Callable[[str], None] | None = None, exit_code: int | None = HUNG_EXIT_CODE,
                 poll_s: float = 0.05):
        """``on_hang(description)`` runs first (e.g. set gRPC health NOT_SERVING); then, unless
        ``exit_code`` is None (tests), the process exits with it."""
        self.on_hang, self.exit_code, self.poll_s = on_hang, exit_code, poll_s
        self._lock = threading.Lock()
        self._active: dict[int, tuple[str, float]] = {}  # token -> (what, deadline)
        self._next = 0
        self.fired: list[str] = []
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str, deadline_s: float):
        with self._lock:
            token, self._next = self._next, self._next + 1
            self._active[token] = (what, time.monotonic() + deadline_s)
        try:
            yield
        finally:
            with self._lock:
                self._active.pop(token, None)

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            now = time.monotonic()
            with self._lock:
                overdue = [(what, d) for what, d in self._active.values() if now > d]
                for token in [t for t, (_, d) in self._active.items() if now > d]:
                    del self._active[token]
            for what, _ in overdue:
                self._fire(what)

    def _fire(self, what: str) -> None:
        self.fired.append(what)
        fail_process(what, f"watchdog: {what} exceeded its deadline; it is hung. Stacks of all threads:\n"
                           f"{all_thread_stacks()}", self.exit_code, [self.on_hang] if self.on_hang is not None else [])


def fail_process(what: str, message: str, exit_code: int | None, hooks: list[Callable[[str], None]] = ()) -> None:
    """End a process that cannot go on from a thread beside the stuck one: ``message`` logged, ``hooks``
    and every hook registered with ``on_any_hang`` told ``what`` (health NOT_SERVING), then exit with ``exit_code``
    (None: no exit, for tests)."""
    log.critical(message)  # (logging not set up: its last resort still writes it to stderr)
    for hook in list(hooks) + _HANG_HOOKS:
        try:
            hook(what)
        except Exception:  # reporting must not stop the exit
            log.exception("hang hook failed")
    if exit_code is not None:
        os._exit(exit_code)
