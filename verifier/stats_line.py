"""The verifier's periodic stats line while it is busy, in the spirit of SGLang's "Decode batch" and vLLM's
"Avg generation throughput" lines:

    Decode batch: running 4, waiting 0, gen throughput 312.5 tok/s, accept len 3.21, KV usage 12.5%,
    preemptions 0, spec on (87% of steps, 3.0 drafts a round, 3.6 rounds a step, 71% overlapped; plain for: exploring 30,
    timing 2;
    5 chain switches); host 1.07 CPUs, 64 µs a token

The share of steps counts the steps that ran the running requests (not a step of prompts alone); drafts a round
is the mean length of the trees verified (less than configured where the policy shortened the chain at batch);
rounds a step, the mean rounds a speculative step ran (queued back to back on the device: below the configured
``--spec-rounds`` where prompts, switches or lone rounds cut the runs short), and the share of those runs queued
behind the one before (overlapped: the device went on while the host read that one back); plain for, the plain decode steps
by the engine's reason (``LLMEngine.plain_reason``: the goodput meter's verdict or exploration, the cost model, a plain
step timing its cost, no request able to draft, the drafter detached or probing); chain switches, how often the
policy changed the chain's depth (each ends a queued run of rounds).

Throughput is over the time the engine was stepping since the last line (an idle gap between two steps
is not counted), accept length over the rounds verified meanwhile (bonus token included, SGLang's
meaning). Host: the whole process's CPU time between steps less than that pause apart (every thread: the engine
loop's, the gRPC front's, the drafter's where it runs in process) over those spans, and per token they generated (a
step after an idle pause is left out: start-up or idle CPU came before it) — near one CPU the
process is bound by its host work and the GIL, not the GPU, and a mode that makes tokens for less CPU serves more.
Fed by the engine loop's thread only; logs at most every ``interval_s`` (0: never).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("verifier.stats")

IDLE_GAP_S = 1.0  # a pause between two steps longer than this was idle time, not work


class StatsLine:
    def __init__(self, interval_s: float, speculative: bool, cpu_clock=time.process_time, thread_clock=time.thread_time):
        """``cpu_clock``: the process's CPU seconds (all threads); ``thread_clock``: the calling thread's (the engine
        loop's: ``step`` is called on it), so that a line tells the engine's own share of the process's CPU from what
        its other threads take (they share its GIL: the commands' reader, metrics, a drafter client's)."""
        self.interval_s, self.speculative = interval_s, speculative
        self._cpu_clock, self._thread_clock = cpu_clock, thread_clock
        self._last_step = None
        # (the thread's clock is read first by a step, on the engine loop's thread: this one may be another)
        self._cpu_at_last_step, self._thread_at_last_step = self._cpu_clock(), None
        self._new_window()

    def _new_window(self) -> None:
        self._since = None  # when the window's first step ended
        self._busy_s = 0.0
        self._tokens = self._rounds = self._accepted = self._steps = self._spec_steps = self._preempted = 0
        self._drafted = self._spec_rounds = self._chain_switches = self._runs = self._overlapped = 0
        self._plain_for: dict[str, int] = {}
        # the process's CPU between steps close together, the seconds and tokens those spans held (a step after an
        # idle pause, or the first, is left out: the CPU before it was start-up or idle, not this work)
        self._cpu_s = self._cpu_wall_s = self._thread_s = 0.0
        self._cpu_tokens = 0

    def step(self, now: float, step_s: float, tokens: int, rounds: int, accepted: int, speculative: bool,
             decoded: bool = True, drafted: int = 0, run: int = 1, plain_reason: str | None = None,
             queued_ahead: bool = False) -> None:
        """One engine step that took ``step_s`` and ended at ``now``: its generated tokens, verified rounds, their
        drafted tokens and accepted drafts; ``decoded``: it ran the running requests (a step of prompts alone does
        not count in the share of steps that speculated); ``run``: the rounds (or decode steps) it ran;
        ``plain_reason``: why a plain step was plain; ``queued_ahead``: its run was queued behind the one before."""
        gap = now - self._last_step if self._last_step is not None else IDLE_GAP_S
        self._busy_s += gap if gap < IDLE_GAP_S else step_s  # the loop's own work between steps is busy time
        cpu, thread = self._cpu_clock(), self._thread_clock()
        if gap < IDLE_GAP_S:
            self._cpu_s += cpu - self._cpu_at_last_step
            self._thread_s += thread - self._thread_at_last_step  # (set by the step before: no gap follows none)
            self._cpu_wall_s += gap
            self._cpu_tokens += tokens
        self._cpu_at_last_step, self._thread_at_last_step = cpu, thread
        if self._since is None:
            self._since = now
        self._last_step = now
        self._tokens += tokens
        self._rounds += rounds
        self._accepted += accepted
        self._drafted += drafted
        self._steps += decoded
        self._spec_steps += speculative and decoded
        self._spec_rounds += run if speculative and decoded else 0
        if speculative and decoded and run > 1:
            self._runs += 1
            self._overlapped += queued_ahead
        if decoded and not speculative and plain_reason is not None:
            self._plain_for[plain_reason] = self._plain_for.get(plain_reason, 0) + 1

    def chain_switched(self, n: int) -> None:
        self._chain_switches += n

    def preempted(self, n: int) -> None:
        self._preempted += n

    def due(self, now: float) -> bool:
        return self.interval_s > 0 and self._since is not None and now - self._since >= self.interval_s

    def line(self, running: int, waiting: int, kv_usage: float, drafter_up: bool = True,
             detached: bool = False) -> str:
        """The line for the window now ending (and a new window begins); ``drafter_up``: whether the drafter
        is reachable now; ``detached``: the engine has it detached from a batch kept plain."""
        throughput = self._tokens / self._busy_s if self._busy_s > 0 else 0.0
        accept = f"{(self._accepted + self._rounds) / self._rounds:.2f}" if self._rounds else "n/a"
        if not self.speculative:
            spec = "spec off (no drafter)"
        elif self._spec_steps:
            drafts = f", {self._drafted / self._rounds:.1f} drafts a round" if self._rounds and self._drafted else ""
            runs = f", {self._spec_rounds / self._spec_steps:.1f} rounds a step" if self._spec_rounds > self._spec_steps else ""
            runs += f", {100 * self._overlapped / self._runs:.0f}% overlapped" if self._runs else ""
            plain = "; plain for: " + ", ".join(f"{why} {n}" for why, n in sorted(
                self._plain_for.items(), key=lambda item: -item[1])) if self._plain_for else ""
            switches = f"; {self._chain_switches} chain switches" if self._chain_switches else ""
            spec = f"spec on ({100 * self._spec_steps / self._steps:.0f}% of steps{drafts}{runs}{plain}{switches})"
        elif not drafter_up:
            spec = "spec off (the drafter is down: reconnecting)"
        elif detached:
            spec = "spec off (the policy: it did not pay; drafter detached, plain steps run target-only)"
        else:
            spec = "spec off (the policy: it did not pay)"
        wall = self._cpu_wall_s
        host = (f"; host {self._cpu_s / wall:.2f} CPUs (the engine thread {self._thread_s / wall:.2f}),"
                f" {1e6 * self._cpu_s / self._cpu_tokens:.0f} µs a token" if wall > 0 and self._cpu_tokens else "")
        text = (f"Decode batch: running {running}, waiting {waiting}, gen throughput {throughput:.1f} tok/s, "
                f"accept len {accept}, KV usage {100 * kv_usage:.1f}%, preemptions {self._preempted}, {spec}{host}")
        self._new_window()
        return text

    def maybe_log(self, now: float, running: int, waiting: int, kv_usage: float, drafter_up: bool = True,
                  detached: bool = False) -> None:
        if self.due(now):
            log.info("%s", self.line(running, waiting, kv_usage, drafter_up, detached))
