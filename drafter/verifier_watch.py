"""The drafter's exit when its verifier has gone for good (``--exit-without-verifier-s``).

Under compose the drafter shares the verifier container's network, IPC and PID namespaces (docker-compose.yml). When
the verifier's container restarts it gets new ones, and a drafter left in the old namespaces waits there forever: no
verifier can reach it, and the new verifier serves without speculation. With this watch the drafter exits once a
verifier that was connected has been gone this long with none connecting again; its restart policy then starts it
in the verifier's namespaces as they now are. A drafter that has never had a verifier waits (a first start's
verifier may take minutes to load), and a verifier that reconnects within the grace keeps it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from tandem.errors import TandemError

log = logging.getLogger("drafter")


class VerifierGone(TandemError):
    """The drafter ends itself: its verifier left and none came back within the grace."""


class VerifierWatch:
    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic):
        if grace_s <= 0:
            raise ValueError(f"the verifier watch's grace must be positive, got {grace_s}")
        self.grace_s = grace_s
        self._clock = clock
        self._streams = 0  # verifier streams past their Hello, open now
        self._gone_since: float | None = None  # when the last one ended; None while one is open or before any
        self.fired = False

    def connected(self) -> None:
        self._streams += 1
        self._gone_since = None

    def disconnected(self) -> None:
        """A stream that ``connected`` ended."""
        self._streams -= 1
        if self._streams == 0:
            self._gone_since = self._clock()

    def overdue(self) -> bool:
        """Whether the verifier left more than the grace ago and none has connected since."""
        return self._gone_since is not None and self._clock() - self._gone_since >= self.grace_s

    async def watch(self, stop: asyncio.Event, poll_s: float | None = None) -> None:
        """Set ``stop`` (the service's shutdown) once ``overdue``; ``fired`` tells the service why it stopped."""
        poll_s = poll_s if poll_s is not None else min(1.0, self.grace_s / 4)
        while not stop.is_set():
            if self.overdue():
                self.fired = True
                log.error("no verifier has connected for %.0f s since the last one left: exiting, so that the "
                          "supervisor starts this drafter again beside the verifier as it is now "
                          "(--exit-without-verifier-s)", self.grace_s)
                stop.set()
                return
            await asyncio.sleep(poll_s)

    def error(self) -> VerifierGone:
        return VerifierGone(f"the verifier left and none connected again within {self.grace_s:g} s "
                            "(--exit-without-verifier-s): exited for the supervisor to restart the drafter")
