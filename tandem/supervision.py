"""The services of ``tandem up`` as child processes (tandem.launcher plans and starts the stack): each started in a
session of its own, restarted after a back-off when it exits, and all stopped in order.

Supervision: once the stack is up, a service that exits is started again after a back-off (0.5 s,
doubling to 10 s; back to 0.5 s once it had served for 30 s). Every service, not only the drafter:
the verifier tolerates a lost drafter and reconnects to the new one; a verifier exits non-zero when
its engine fails (its requests failed first), precisely so that it is restarted, and the gateway
answers 503 meanwhile and reconnects; a gateway that dies would otherwise leave a stack nobody can
reach.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from tandem import args as shared
from tandem.service_runtime import LAUNCHER_PID_ENV

log = logging.getLogger("tandem.up")
RESTART_BACKOFF_S = (0.5, 10.0)  # first delay, most; doubled at each exit in a row
STABLE_S = 30.0  # a service that served this long restarts after the first delay again
STOP_TIMEOUT_S = 30.0  # a service told to stop that has not exited after this long is killed
STOP_NOTICE_S = 10.0  # ... and one still running after this long is named (past the gateway's grace period)


@dataclass
class Backoff:
    first_s: float = RESTART_BACKOFF_S[0]
    most_s: float = RESTART_BACKOFF_S[1]
    stable_s: float = STABLE_S
    _next_s: float = 0.0

    def delay(self, ran_s: float) -> float:
        """The wait before the next start of a service that ran ``ran_s`` seconds before exiting."""
        if ran_s >= self.stable_s or self._next_s == 0.0:
            self._next_s = self.first_s
        delay, self._next_s = self._next_s, min(self._next_s * 2, self.most_s)
        return delay


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # set while it is down and waiting for its back-off
    restarts: int = 0
    backoff: Backoff = field(default_factory=Backoff)
    healthy_at: float | None = None  # when it last said it serves (None: not since its latest start)

    def start(self, env: dict) -> None:
        # The service asks for its parent-death signal itself (tandem.service_runtime.die_with_launcher): no hook
        # between fork and exec, so no gRPC fork handlers in the child. (Every start is from the main thread: a thread
        # that starts services would take them with it when it ends.)
        # A session of its own: a terminal's Ctrl-C reaches the launcher alone, which stops the services in order
        # (the gateway first, drained, then the others), where each one stopping on its own raced the others: streams
        # the gateway was draining were cut by the verifier's own stop.
        if self.name != "gateway":  # (only the gateway checks the API key: no other service's environment holds it)
            env = {k: v for k, v in env.items() if k != shared.API_KEY_ENV}
        if env.get("OTEL_SERVICE_NAME"):  # one name for the stack: each service's traces still told apart
            env = {**env, "OTEL_SERVICE_NAME": f"{env['OTEL_SERVICE_NAME']}-{self.name}"}
        self.proc = subprocess.Popen(self.argv, env={**env, LAUNCHER_PID_ENV: str(os.getpid())}, start_new_session=True)
        self.started_at, self.restart_at, self.healthy_at = time.monotonic(), None, None


def supervise(children: list[Child], env: dict, poll_s: float = 0.2, until=lambda: False,
               healthy=lambda child: True) -> int:
    """Restart whichever service exits, after its back-off, and say when a restarted one serves again (``healthy``);
    returns through an interrupt (or ``until()``). A run counts as stable from when the service served, not from its
    start: a long load followed by a crash must not restart at the first delay forever."""
    for child in children:
        child.healthy_at = child.healthy_at or time.monotonic()  # (started and waited for by run_up)
    while not until():
        now = time.monotonic()
        for child in children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restarts += 1
                    log.warning("restarting %s (restart %d)", child.name, child.restarts)
                    child.start(env)
                continue
            code = child.proc.poll()
            if code is not None:
                served = now - child.healthy_at if child.healthy_at is not None else 0.0
                delay = child.backoff.delay(served)
                child.restart_at = now + delay
                log.warning("%s exited (%s); restarting it in %.1f s", child.name, _exit_said(code), delay)
            elif child.healthy_at is None and healthy(child):
                child.healthy_at = now
                log.info("%s serves again (%.1f s after its restart)", child.name, now - child.started_at)
        time.sleep(poll_s)
    return 0


def _exit_said(code: int) -> str:
    """An exit status in words: ``code 3``, or the signal that killed it (``killed by SIGKILL``)."""
    if code >= 0:
        return f"code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def stop_all(children: list[Child]) -> list[str]:
    """Each service stopped after the one that depends on it has exited: the gateway first (no new requests; its
    streams drain, as long as its grace period allows), then the verifier, then the drafter. One stuck for STOP_TIMEOUT_S is
    killed, saying so; a second Ctrl-C kills all that are left, naming them. → the services killed."""
    hurry, killed = False, []
    for child in reversed(children):
        try:
            if child.proc is None or child.proc.poll() is not None:  # (never started, or exited and reaped)
                continue
            if not hurry:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(timeout=STOP_NOTICE_S)
                except subprocess.TimeoutExpired:  # (a stuck service's stop is otherwise a silence of STOP_TIMEOUT_S)
                    say(f"waiting for {child.name} to stop (killed {STOP_TIMEOUT_S - STOP_NOTICE_S:.0f} s from now; "
                         "Ctrl-C again to kill everything now) ...")
                    child.proc.wait(timeout=STOP_TIMEOUT_S - STOP_NOTICE_S)
                continue
        except subprocess.TimeoutExpired:
            say(f"{child.name} did not stop within {STOP_TIMEOUT_S:.0f} s: killed")
        except KeyboardInterrupt:
            hurry = True
        if hurry:
            say(f"{child.name}: killed (interrupted again)")
        _kill(child)
        killed.append(child.name)
    return killed


def say(message: str) -> None:
    """A line to the operator on stderr; none where it cannot be written (a hung-up terminal: the stop goes on)."""
    with contextlib.suppress(OSError):
        print(message, file=sys.stderr, flush=True)


def _kill(child: Child) -> None:
    """SIGKILL to the service's process group (a verifier's tensor-parallel workers are in it), then reaped. Only a
    process not reaped yet: its pid, and so its group's, cannot have gone to another process."""
    while True:
        try:
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait()
            return
        except KeyboardInterrupt:  # (yet another Ctrl-C: this is what it asks for already)
            continue
