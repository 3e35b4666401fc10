"""RoundProfiler: a torch-profiler timeline of some of the drafter's rounds, for finding where a round's
time goes inside the drafter process (host ops, kernel launches, waits, the kernels themselves).

``--profile-rounds N`` traces rounds ``skip+1 .. skip+N`` of the process (the first ``skip`` are
warm-up: allocator growth, first launches), then writes a Chrome trace to ``--profile-dir`` and logs
the busiest host ops and kernels per round. Off (N = 0) it costs one integer comparison per round.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("drafter.profiling")
SKIP_ROUNDS = 32


class RoundProfiler:
    def __init__(self, rounds: int, folder: str | None, skip: int = SKIP_ROUNDS):
        self.rounds, self.skip = rounds, skip
        self.folder = Path(folder or ".")
        self._seen = 0
        self._profile = None

    @property
    def active(self) -> bool:
        return self._profile is not None

    def round_done(self) -> None:
        """Call after every round, once its reply is sent: starts the trace after the warm-up, ends it
        after ``rounds`` more. Starting and ending take seconds (the export): the verifier may count that
        round as late and reconnect once — profile with a generous --drafter-deadline-ms."""
        if self.rounds <= 0:
            return
        self._seen += 1
        try:
            if self._seen == max(self.skip, 1):
                self._start()
            elif self._seen == self.skip + self.rounds and self._profile is not None:
                self._finish(self.rounds)
        except Exception:  # noqa: BLE001 - a profiling failure must not cost the drafter anything more
            log.exception("profiling failed; no trace")
            self._profile, self.rounds = None, 0

    def close(self) -> None:
        """At shutdown: end a trace still running and write what it holds (a process that exits with
        the profiler active crashes)."""
        if self._profile is not None:
            try:
                self._finish(self._seen - max(self.skip, 1))
            except Exception:  # noqa: BLE001
                log.exception("profiling failed; no trace")
                self._profile = None

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.folder.mkdir(parents=True, exist_ok=True)  # fail here, before the trace, not after it
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities)
        prof.start()
        self._profile = prof
        log.info("profiling the next %d rounds", self.rounds)

    def _finish(self, rounds: int) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof, self._profile = self._profile, None
        prof.stop()
        path = self.folder / f"drafter-rounds-{os.getpid()}.json"
        prof.export_chrome_trace(str(path))
        events = prof.key_averages()
        n = max(rounds, 1)
        lines = [f"trace of {rounds} rounds written to {path}; per round:"]
        for label, key in (("host", "self_cpu_time_total"), ("device", "self_device_time_total")):
            top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:12]
            lines += [f"  {label} {getattr(e, key) / 1e3 / n:8.3f} ms  x{e.count / n:5.1f}  {e.key[:80]}"
                      for e in top if getattr(e, key) > 0]
        log.info("\n".join(lines))
