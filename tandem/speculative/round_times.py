"""RoundTimes: the chain-depth weighing's view of measured round times at one batch bucket
(tandem.speculative.chain_depth), read from the policy's step costs (tandem.speculative.step_costs)."""

from __future__ import annotations

import functools
import math

from tandem.speculative.step_costs import FRESH_STEPS, MIN_TIMED_STEPS, RECENT_STEPS, StepCosts, per_step


class RoundTimes:
    """ChainDepth's ``round_time(width)`` at ``bucket`` (and its ``spread(width)``): every depth's rounds of one class —
    queued in runs where each depth has run samples here, else the engine's mix of runs and lone rounds. A depth last
    timed while arrivals cut runs short and one timed in runs differ by their mix, not by their depth (compared across
    mixes, depths about even took turns). The class is settled at the first call (a weighing's). A width last served
    more than ``FRESH_STEPS`` timed steps ago here (``fresh_steps``: ChainDepth spaces some widths' further), or timed
    by the warm-up alone once serving has begun here, reads unmeasured: ChainDepth times it again (``forget`` first)
    rather than weigh the running depth's fresh times against old ones (the demo pair over REST held chains of 2 at
    batch 1 for minutes against the full chain's times from its first seconds, which the always-full stack beat by 16
    %).
    Every sample counts, none left out: a trial times a width in 3-4 steps, the running width has 16, and leaving out
    the slowest of each read the trial's few about 8 % faster where a served step's time now and then holds a long wait
    (the GIL, streaming). Such waits are the serving's, not a width's: a width's ``spread`` is the scatter of every
    weighed width's samples about their own means, pooled, over the root of its own count — 3 clean steps of a
    trial are no sign of a quieter width (weighed on their own scatter, chance runs of them changed depth every tenth
    of a second over REST).
    Each width is read from its latest samples, as many as the fewest-timed width among those timed last has (right
    after a trial, the trial's; ``MIN_TIMED_STEPS`` at least, fewer: unmeasured): served, step times drift in spells
    (the demo pair over REST on an H100: a chain's 16 latest steps held 9 of 4-31 ms among 7 of about 2 ms, 1.77 ms a
    round, against 0.66 ms read by a 5-step trial of another chain), so the running width's steps just before a trial,
    not its longer record, are what the trial is weighed against."""

    def __init__(self, costs: StepCosts, bucket: int, ladder: tuple, fresh_steps=lambda width: FRESH_STEPS):
        """``fresh_steps(width)``: timed steps after which a width not served since reads unmeasured (ChainDepth
        spaces the trials of a width far behind: ``trial_spacing``)."""
        self.costs, self.bucket, self.ladder, self.fresh_steps = costs, bucket, ladder, fresh_steps
        self._by_width: dict[int, list] = {}  # width -> its samples (a weighing asks for each several times)

    @functools.cached_property
    def _class(self) -> bool | None:
        """Runs (True) where every depth has run samples here, else the engine's mix (None)."""
        return True if all(self.costs.step_time(self.bucket, True, runs=True, width=c.num_draft_tokens) is not None
                           for c in self.ladder) else None

    def _samples(self, width: int) -> list:
        if width not in self._by_width:
            fresh = self.costs.samples_since(self.bucket, width) <= self.fresh_steps(width)
            self._by_width[width] = self.costs.round_times(self.bucket, width, self._class) if fresh else []
        return self._by_width[width]

    def _span(self) -> int:
        """Samples each width is read from: the fewest any measured width among the latest timed here has (right after
        a trial, the trial's: the running width is read from its steps just before it), else any measured width."""
        counts = {c.num_draft_tokens: len(self._samples(c.num_draft_tokens)) for c in self.ladder}
        measured = {w: n for w, n in counts.items() if n >= MIN_TIMED_STEPS}
        latest = [n for w, n in measured.items() if self.recent(w)]
        return min(latest or measured.values(), default=0)

    def _window(self, width: int) -> list:
        samples = self._samples(width)
        return samples[-self._span():] if len(samples) >= MIN_TIMED_STEPS else []

    def __call__(self, width: int) -> float | None:
        return per_step(self._window(width))

    def weighed_on(self, width: int) -> int:
        """How many samples ``__call__(width)`` rests on (0: unmeasured)."""
        return len(self._window(width))

    def seeded(self, width: int) -> float | None:
        """What a round ``width`` wide cost here in the warm-up (StepCosts.seeded_round_time)."""
        return self.costs.seeded_round_time(self.bucket, width)

    def recent(self, width: int) -> bool:
        """Whether ``width`` ran among the latest timed steps here (the running width, or one a trial has just timed)."""
        return self.costs.samples_since(self.bucket, width) <= RECENT_STEPS

    @functools.cached_property
    def _pooled_scatter(self) -> float | None:
        """The relative standard deviation of one sample about its width's mean, pooled over the weighed widths
        (settled at the first call); None under two degrees of freedom."""
        squares, freedom = 0.0, 0
        for spec in self.ladder:
            per_round = [s[0] / s[1] for s in self._window(spec.num_draft_tokens)]
            if len(per_round) >= 2:
                mean = sum(per_round) / len(per_round)
                squares += sum((x / mean - 1.0) ** 2 for x in per_round)
                freedom += len(per_round) - 1
        return math.sqrt(squares / freedom) if freedom >= 2 else None

    def forget(self, width: int) -> None:
        self.costs.forget_width(self.bucket, width)
        self._by_width.pop(width, None)

    def spread(self, width: int) -> float | None:
        """The relative standard error of ``__call__(width)`` (None: too few samples to say)."""
        scatter, n = self._pooled_scatter, self.weighed_on(width)
        return None if scatter is None or not n else scatter / math.sqrt(n)
