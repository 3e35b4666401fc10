"""StepCosts: what a plain step and a speculative round cost at each batch size, as measured — the speculation
policy's cost model (tandem.speculative.policy) rests on it.

Costs are kept per batch bucket (powers of two: ``cost_bucket``) from the recent steps there — their time over their
steps, the slowest left out — apart for runs (several steps queued at once) and single steps, and a round's by its
verify width (a chain the policy shortens at batch is another width: tandem.speculative.chain_depth). What only
speculating pays for an arrival (the drafter's extension over the prompt) is kept as a cost per output token.
``DecayedMean`` is the decayed mean both these and the policy's acceptance use.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass, field

# Timed steps at a bucket after which a round width not served since reads unmeasured there (round_times.RoundTimes)
FRESH_STEPS = 1024
# A width's round time resting on fewer timed steps is unknown (round_times.RoundTimes; a trial times it): on the demo
# pair over REST one step read a chain of 1 at 0.13 ms a round where its rounds took 1.1-1.6 ms, and the bucket took it
MIN_TIMED_STEPS = 3
RECENT_STEPS = 2  # a width timed within this many of a bucket's latest timed steps is current there (RoundTimes.recent)
MIN_PLAIN_SHARE = 0.05  # the arrival-adjusted plain step never counts below this share of its time (the ratio stays finite)


@functools.lru_cache(maxsize=1024)
def cost_bucket(batch_size: int) -> int:
    """The power of two nearest to ``batch_size`` (in log scale): where its step costs are kept."""
    return 1 << max(0, round(math.log2(max(1, batch_size))))


def _round_kind(width: int | None) -> str:
    """The key of speculative step times for rounds ``width`` wide (None or 0: width unknown, kept apart)."""
    return f"spec{width}" if width else "spec"


@dataclass
class _StepTimes:
    """A bucket's recent (seconds, steps, serial) samples by kind — "plain", "spec", "resume" (speculative steps
    that first caught the drafter up) — and by whether they were runs (several steps queued at once) or
    single steps: arrivals cut runs short, and a short run costs more per step in one mode than the other,
    so costs are compared within one class where both modes have samples."""
    samples: dict = field(default_factory=dict)  # (kind, run) -> deque

    def of(self, kind: str, run: bool | None = None) -> list:
        if run is not None:
            return list(self.samples.get((kind, run), ()))
        return sorted((s for r in (False, True) for s in self.samples.get((kind, r), ())), key=lambda s: s[2])


class StepCosts:
    """The cost bookkeeping of a policy (its base class): ``cfg`` holds ``step_samples``, ``fixed_cost_ratio``,
    ``default_cost_ratio`` and ``arrival_window``; ``depth`` (a ChainDepth or None) says which width a bucket's rounds
    run at now."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._times: dict[int, _StepTimes] = {}  # bucket -> recent step times (seconds per round / step)
        self._step_times_known: dict[int, dict] = {}  # bucket -> {(kind, runs): step_time}, until its next sample
        # What an arrival costs only while speculating — the drafter's extension over the prompt — per
        # prompt token, and the traffic's prompt tokens per output token: together, a cost per output token.
        self._extend_per_token = DecayedMean(cfg.arrival_window)
        self._prompt_per_output = DecayedMean(cfg.arrival_window)
        self.spec_steps_since_plain = 0  # decode steps (rounds) since the last plain step
        self.plain_steps_since_spec = 0
        self.depth = None  # the policy's ChainDepth (the chain by batch bucket, for the spec it was built for), or None
        self._served: dict[int, int] = {}  # bucket -> steps timed there while serving (not the warm-up's)
        self._last_served: dict[tuple[int, str], int] = {}  # (bucket, kind) -> _served there at its latest sample
        self.spec_width: int | None = None  # the verify width of the latest speculative step observed
        self._serial = 0  # timed steps observed: orders samples of different kinds in time
        self._seeded: dict[tuple[int, int], list] = {}  # (bucket, verify width) -> the warm-up's seconds per round

    def _spec_kind(self, bucket: int, width: int | None) -> str:
        """The key of speculative step times at ``bucket`` for rounds ``width`` wide (None: the width in use there)."""
        if width is None:
            width = self.depth.chosen_width(bucket) if self.depth is not None else self.spec_width
        return _round_kind(width)
    def observe_step(self, batch_size: int, speculative: bool, steps: int = 1, seconds: float | None = None,
                     resumed: bool = False, width: int | None = None, detached: bool = False,
                     seeded: bool = False) -> None:
        """``steps`` decode steps (or rounds) of ``batch_size`` requests ran; ``seconds``: their wall time
        (None: not timed, e.g. a prefill shared the step); ``resumed``: a speculative step that first sent
        the drafter what plain steps held (its time is the price of resuming, not of a round); ``width``: a
        speculative step's verify width (its times are kept by width; None: unknown, kept apart); ``detached``: plain
        steps timed without the drafter, as the warm-up times them (kept apart: ``attached_plain_tax``); ``seeded``: timed
        by the warm-up (not serving: see ``samples_since``)."""
        self.observe_steps(batch_size, speculative, ((steps, seconds),), resumed, width, detached, seeded)

    def observe_steps(self, batch_size: int, speculative: bool, runs, resumed: bool = False, width: int | None = None,
                      detached: bool = False, seeded: bool = False) -> None:
        """``observe_step`` for engine steps of one kind in a row, ``runs`` their ``(steps, seconds)`` oldest first:
        as many calls would record (the engine's accounting hands over a detached period's plain steps a few at a
        time: one call each cost a served step ~15 µs of host)."""
        if speculative and width:
            self.spec_width = width
        steps_run = sum(steps for steps, _ in runs)
        if speculative:
            self.spec_steps_since_plain += steps_run
            self.plain_steps_since_spec = 0
        else:
            self.plain_steps_since_spec += steps_run
            self.spec_steps_since_plain = 0
        timed = [(seconds, steps) for steps, seconds in runs if seconds is not None]
        if not timed:
            return
        bucket = cost_bucket(batch_size)
        times = self._times.get(bucket) or self._times.setdefault(bucket, _StepTimes())  # (get first: every step)
        kind = ("resume" if resumed else _round_kind(width) if speculative
                else "plain_detached" if detached else "plain")
        known = self._step_times_known.get(bucket)
        if known:
            for runs_class in (True, False, None):
                known.pop((kind, runs_class), None)
        keep = self.cfg.step_samples
        for seconds, steps in timed:
            samples = times.samples.get((kind, steps > 1))
            if samples is None:
                samples = times.samples[kind, steps > 1] = deque()
            self._serial += 1
            samples.append((seconds, steps, self._serial))
            while len(samples) > keep:
                samples.popleft()
            if seeded and speculative and width and not resumed and not detached:
                self._seeded.setdefault((bucket, width), []).append(seconds / steps)
        if not seeded:
            served = self._served[bucket] = self._served.get(bucket, 0) + len(timed)
            self._last_served[bucket, kind] = served

    def step_time(self, batch_size: int, speculative: bool, resumed: bool = False,
                  runs: bool | None = None, width: int | None = None, detached: bool = False) -> float | None:
        """Seconds per step (or round) at ``batch_size``'s bucket: the recent samples' total time over their
        total steps — what the engine's mix of runs and single steps really costs, which a median per
        step misses (a run of 4 rounds and a lone round are one sample each) — leaving out the slowest
        sample once there are three (a first launch, a collection). ``runs``: of runs only (True), of
        single steps only (False), or of both (None). ``width``: of rounds that wide (None: the width in use).
        ``detached``: of plain steps timed without the drafter (observe_step's)."""
        bucket = cost_bucket(batch_size)
        kind = self._kind(bucket, speculative, resumed, width, detached)
        known = self._step_times_known.setdefault(bucket, {})  # (a decision asks several times per step)
        if (kind, runs) not in known:
            times = self._times.get(bucket)
            known[kind, runs] = None if times is None else _trimmed_per_step(
                times.samples.get((kind, r), ()) for r in ((False, True) if runs is None else (runs,)))
        return known[kind, runs]

    def round_times(self, batch_size: int, width: int, runs: bool | None) -> list:
        """The kept (seconds, steps, serial) samples of rounds ``width`` wide at ``batch_size``'s bucket of the class
        ``runs``, oldest first, none left out (round_times.RoundTimes: see there)."""
        times = self._times.get(cost_bucket(batch_size))
        return [] if times is None else times.of(_round_kind(width), runs)

    def _kind(self, bucket: int, speculative: bool, resumed: bool = False, width: int | None = None,
              detached: bool = False) -> str:
        return ("resume" if resumed else self._spec_kind(bucket, width) if speculative
                else "plain_detached" if detached else "plain")

    def samples_since(self, batch_size: int, width: int) -> float:
        """Steps timed while serving at ``batch_size``'s bucket since its last served round ``width`` wide: 0 while
        none was served there (the warm-up's times alone: one occasion), infinite where only the warm-up timed that
        width. Times taken apart in time are not comparable (the host's and the device's pace drift)."""
        bucket = cost_bucket(batch_size)
        served = self._served.get(bucket, 0)
        if not served:
            return 0.0
        last = self._last_served.get((bucket, _round_kind(width)))
        return math.inf if last is None else float(served - last)

    def seeded_round_time(self, batch_size: int, width: int) -> float | None:
        """Seconds a round ``width`` wide cost at ``batch_size``'s bucket in the warm-up (in process, no serving around
        it): the median of its steps (a first launch left out by it); None where the warm-up timed none."""
        per_round = sorted(self._seeded.get((cost_bucket(batch_size), width), ()))
        if not per_round:
            return None
        mid = len(per_round) // 2
        return per_round[mid] if len(per_round) % 2 else 0.5 * (per_round[mid - 1] + per_round[mid])

    def forget_width(self, batch_size: int, width: int) -> None:
        """Drop the round times ``width`` wide at ``batch_size``'s bucket (about to be timed afresh)."""
        bucket = cost_bucket(batch_size)
        times = self._times.get(bucket)
        if times is not None:
            for runs in (False, True):
                times.samples.pop((_round_kind(width), runs), None)
        self._step_times_known.pop(bucket, None)

    def attached_plain_tax(self, batch_size: int) -> float | None:
        """What a plain step with the drafter attached costs over one without it at ``batch_size``'s bucket, less one
        (a drafter service: each attached step ships its features), from plain steps timed both ways in runs (the
        warm-up's); None unless both were."""
        attached = self.step_time(batch_size, False, runs=True)
        detached = self.step_time(batch_size, False, runs=True, detached=True)
        return attached / detached - 1 if attached and detached else None

    def _switch_cost(self, bucket: int) -> float:
        """Seconds a switch back to speculation costs at ``bucket`` beyond a plain step (the drafter's catch-up over
        the held plain steps: a resume's measured time); 0 until measured."""
        resume, plain = self.step_time(bucket, True, resumed=True), self.step_time(bucket, False)
        return max(0.0, resume - plain) if resume is not None and plain is not None else 0.0

    def cost_ratio(self, batch_size: int, runs: bool | None = None) -> float:
        """t_spec / t_plain at ``batch_size``'s bucket, or at the nearest bucket measured both ways; within
        ``runs``' class (runs, or single steps) where both kinds have samples of it there."""
        if self.cfg.fixed_cost_ratio is not None:
            return self.cfg.fixed_cost_ratio
        b = cost_bucket(batch_size)
        if self.step_time(b, False) is None or self.step_time(b, True) is None:  # (asked every step: its own first)
            measured = [(abs(math.log2(m) - math.log2(b)), m) for m in self._times
                        if self.step_time(m, False) is not None and self.step_time(m, True) is not None]
            if not measured:
                return self.cfg.default_cost_ratio
            _, b = min(measured)
        spec, plain = self.step_time(b, True, runs=runs), self.step_time(b, False, runs=runs)
        if spec is None or plain is None:
            spec, plain = self.step_time(b, True), self.step_time(b, False)
        # Per output token, speculating also pays the drafter's extension over each arriving prompt: with n
        # requests, τ tokens a round beat one a plain step when τ >= t_spec / (t_plain - n x that cost).
        arrival = self.arrival_cost_per_output_token()
        return spec / max(plain - batch_size * arrival, MIN_PLAIN_SHARE * plain)

    def arrival_cost_per_output_token(self) -> float:
        """Seconds of the drafter's prompt extension per output token of the recent traffic (0 until known)."""
        per_token, ratio = self._extend_per_token.mean, self._prompt_per_output.mean
        return 0.0 if per_token is None or ratio is None else per_token * ratio

    def observe_arrivals(self, prompt_tokens: int, seconds: float) -> None:
        """Prompts of ``prompt_tokens`` tokens, prefilled alone while speculating, took ``seconds`` to extend
        into the drafter (a cost plain decoding does not pay: it holds them)."""
        self._extend_per_token.decay(1)
        self._extend_per_token.add(seconds / prompt_tokens, weight=prompt_tokens)

    def observe_finished(self, prompt_tokens: int, output_tokens: int) -> None:
        self._prompt_per_output.decay(1)
        self._prompt_per_output.add(prompt_tokens / output_tokens, weight=output_tokens)


def _trimmed_per_step(groups) -> float | None:
    """``per_step`` of the (seconds, steps, serial) samples in ``groups``, the slowest a step left out once there are
    three (of equally slow ones, the latest). One pass: step_time runs at every step, and sorting its samples there
    cost more than the rest of the decision."""
    seconds = steps = count = 0
    worst = None  # (seconds a step, serial, seconds, steps)
    for samples in groups:
        for s, n, serial in samples:
            seconds, steps, count = seconds + s, steps + n, count + 1
            if worst is None or (s / n, serial) > worst[:2]:
                worst = (s / n, serial, s, n)
    if count >= 3:
        seconds, steps = seconds - worst[2], steps - worst[3]
    return seconds / steps if count else None


def per_step(kept: list) -> float | None:
    """Seconds per step of ``kept`` (seconds, steps) samples: their total time over their total steps."""
    return sum(s[0] for s in kept) / sum(s[1] for s in kept) if kept else None


def _keep(window: int) -> float:
    """Per-sample decay of a mean over about ``window`` samples (1: the latest alone)."""
    return 1.0 - 1.0 / max(1, window)


class DecayedMean:
    """Mean and variance of samples whose weights decay (``decay``) as they age."""

    def __init__(self, window: int):
        self.keep, self.total, self.squares, self.weight = _keep(window), 0.0, 0.0, 0.0

    def decay(self, ages: int) -> None:
        factor = self.keep ** ages
        self.total, self.squares, self.weight = factor * self.total, factor * self.squares, factor * self.weight

    def add(self, value: float, weight: float = 1.0) -> None:
        """A sample of ``weight`` (a ratio's denominator as its weight makes the mean a ratio of decayed sums)."""
        self.total += weight * value
        self.squares += weight * value * value
        self.weight += weight

    @property
    def mean(self) -> float | None:
        return self.total / self.weight if self.weight else None

    @property
    def variance(self) -> float:
        if not self.weight:
            return 0.0
        mean = self.total / self.weight
        return max(0.0, self.squares / self.weight - mean * mean)
