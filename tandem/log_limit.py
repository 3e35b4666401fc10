"""Log lines that a caller can repeat at will, said once every few seconds per kind with a count of the rest: a
dead verifier failing each request, callers without the internal secret (anyone who reaches an internal port could
otherwise write the log at thousands of lines a second); and RepeatFilter for libraries' loggers that say a line per
failed attempt (OpenTelemetry's exporter while its collector is down: every service, every few seconds)."""

from __future__ import annotations

import logging
import time


class LimitedLog:
    def __init__(self, logger: logging.Logger, every_s: float = 5.0, clock=time.monotonic):
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self._last: dict[tuple, tuple[float, int]] = {}  # kind -> (said at, held since)

    def warning(self, kind: tuple, message: str, *args) -> None:
        """``message % args`` as a WARNING, unless a line of ``kind`` was said less than ``every_s`` ago: then it is
        counted, and the next line of that kind says how many were held back."""
        now = self.clock()
        said, held = self._last.get(kind, (None, 0))
        if said is not None and now - said < self.every_s:
            self._last[kind] = (said, held + 1)
            return
        if held:
            message, args = message + " (and %d more like it in %.0f s)", (*args, held, now - said)
        self.logger.warning(message, *args)
        if len(self._last) > 1024:  # (kinds name peers: they must not pile up)
            self._last.clear()
        self._last[kind] = (now, 0)


class RepeatFilter(logging.Filter):
    """A logger's records at most once every ``every_s`` per level and message (its format string, so a line whose
    numbers change is one kind); the next one let through says how many were held back. Installed on a library's
    logger (``logging.getLogger(name).addFilter``): it sees what that logger itself logs."""

    def __init__(self, every_s: float = 60.0, clock=time.monotonic):
        super().__init__()
        self.every_s, self.clock = every_s, clock
        self._last: dict[tuple, tuple[float, int]] = {}  # (logger, level, message) -> (said at, held since)

    def filter(self, record: logging.LogRecord) -> bool:
        key, now = (record.name, record.levelno, str(record.msg)), self.clock()
        said, held = self._last.get(key, (None, 0))
        if said is not None and now - said < self.every_s:
            self._last[key] = (said, held + 1)
            return False
        if held:
            record.msg, record.args = f"{record.getMessage()} (and {held} more like it in {now - said:.0f} s)", ()
        if len(self._last) > 256:  # (kinds are a library's format strings: few, but never a pile)
            self._last.clear()
        self._last[key] = (now, 0)
        return True
