"""A one-line progress display on stderr for long work: step, loss, tokens/s and ETA.

On a terminal the line is redrawn in place (``\\r``); when stderr is a file or a pipe (CI logs, a
service starting the demo build), a full line is printed at most every ``every_s`` seconds, so logs
stay short but never silent.
"""

from __future__ import annotations

import sys
import time


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    def __init__(self, label: str, total: int, start: int = 0, every_s: float = 10.0, stream=None):
        self.label, self.total, self.start = label, total, start
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every_s = 0.25 if self.tty else every_s
        self.t0 = time.perf_counter()
        self.tokens = 0
        self._last_print = 0.0
        self._shown = False
        self._first: tuple[float, int, int] | None = None  # (time, step, tokens) at the first update

    def update(self, step: int, tokens: int = 0, force: bool = False, **metrics: float) -> None:
        """``step`` done out of ``total``; ``tokens`` processed since the last update."""
        self.tokens += tokens
        now = time.perf_counter()
        if self._first is None:
            self._first = (now, step, self.tokens)
        if not force and now - self._last_print < self.every_s and step < self.total:
            return
        self._last_print = now
        elapsed = now - self.t0
        # Rate and ETA from the first update on where there are steps since: the first step pays one-off costs
        # (torch.compile: a minute and more), which would make the ETA of a long run many times too long.
        t1, step1, tokens1 = self._first
        eta_text = None
        if step > step1 and now > t1:
            rate, eta = (self.tokens - tokens1) / (now - t1), (now - t1) / (step - step1) * (self.total - step)
        else:  # (the first update alone: its time holds those costs, so no ETA until a second one)
            rate, eta = (self.tokens / elapsed if elapsed > 0 else 0.0), 0.0
            eta_text = "?" if step < self.total else None
        parts = [f"{self.label} {step}/{self.total}"]
        parts += [f"{k} {v:.4g}" for k, v in metrics.items()]
        if self.tokens:
            parts.append(f"{rate:,.0f} tok/s")
        parts.append(f"{format_seconds(elapsed)} elapsed, ETA {eta_text or format_seconds(eta)}")
        line = " | ".join(parts)
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._shown = True

    def close(self, message: str | None = None) -> None:
        if self.tty and self._shown:
            self.stream.write("\n")
        if message:
            self.stream.write(message + "\n")
        self.stream.flush()


def note(message: str) -> None:
    """A one-off status line on stderr (phases of a long run)."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
