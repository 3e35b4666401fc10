"""ChainDepth: how many tokens a speculating batch's chains draft, by the goodput each depth promises.

A chain of ``d`` drafts (``--speculative-eagle-topk 1``) is verified ``d + 1`` tokens wide. At batch 1 a wider
verify costs about what a narrow one does, so the longest chain pays; at a large batch the verify is
compute-bound and its cost grows with the width, while the chain's last drafts are the ones least often
accepted — so a shorter chain can make more tokens a second than the configured one (SGLang and vLLM shorten
speculation with batch size by a fixed table; here it is measured). The depths are the configured chain and
every shorter one (``chain_ladder``); the engine captures graphs for each.

What each depth would make comes from acceptance by position: of the rounds whose chain reached position ``i``
with every draft before it accepted, the share that accepted draft ``i`` too (decayed over about
``window`` of the rounds that reached it). A depth's tokens per round are then 1 + sum over its positions of the product of those
shares up to there. Rounds at any depth teach the positions they reach; positions a shorter chain does not reach
are taught again by one step at the full depth every ``explore_every`` steps at a shorter one. Each depth's
cost is the policy's measured round time at its width and batch bucket (of rounds queued in runs where every
depth has such samples there: SpeculationPolicy._round_times), seeded by the warm-up; where it is not (an
engine that was not warmed up, a bucket the warm-up did not reach, or times too old to weigh against the running
depth's: tandem.speculative.round_times.RoundTimes), a weighing drafts ``TRIAL_STEPS`` steps at that depth to time
it, up to ``UNMEASURED_TRIALS`` times in a row, and a depth still unmeasured is not chosen. A depth shorter than the
running one is taken only on times as recent as the running one's — its trial's, weighed against the running depth's
steps just before it (served, step times drift in spells: RoundTimes); one that leads on older times is timed again
first. A depth that a longer chain beats at the warm-up's round times is timed only once in ``OUTDONE_TRIAL_GAP``
weighings while unmeasured (``_outdone``: served alike, that gap only widens; on a small target whose rounds cost about
the same at every width this spares the cold start's trials).
A bucket keeps its depth unless another promises ``margin`` more tokens a second, weighed again every ``recheck_every``
speculative steps; after a change it keeps the new depth for ``dwell`` weighings (each change ends the queued run of
rounds, and round times measured just after one are the noisiest: on the demo pair over REST depths about even took
turns several times a second). A batch that comes into a bucket holding another depth than the one running keeps the running one unless
the bucket's best beats it there by the margin. A lead must also stand out of the noise: ``NOISE_Z`` standard errors
of the round times compared (the samples' scatter pooled over the widths weighed, over the root of each one's count:
RoundTimes; on the demo pair's sub-millisecond rounds served over REST, a width's times scatter by tens of percent).
And any change must promise enough to pay its price (``SWITCH_PRICE_STEPS``) over the steps the batch is expected to
stay in the bucket once it comes in (measured by bucket): a steady load's batch moves between two buckets all the time, and per-bucket depths changed at each
crossing (111-202 changes in 4 s at concurrency 8 on the demo pair). Rounds are counted as they come and folded into
the shares when the depths are weighed, so accounting costs one dictionary update per request and round.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

from tandem.speculative.step_costs import FRESH_STEPS

log = logging.getLogger("tandem.policy")

PRIOR_ROUNDS = 2.0  # a position with no rounds yet is taken to accept half of its drafts, worth this many rounds
MIN_ROUNDS = 16.0  # (decayed) rounds observed before a shorter chain is weighed at all: the full one until then
# What changing depth costs, in steps: the queued run in flight ends with none behind it, and the next is queued with
# nothing to overlap its host work
SWITCH_PRICE_STEPS = 1.0
NOISE_Z = 2.0  # a depth's lead must exceed this many standard errors of the two round times' ratio
UNMEASURED_TRIALS = 3  # trials in a row of a depth whose round time is unknown at a bucket before it is given up there
# Steps a trial drafts at that depth: the engine leaves the two steps around a change of depth untimed
TRIAL_STEPS = 6
# A depth whose trial found it this far behind the bucket's best (in tokens a second) is timed again only after twice
# as many steps as before (up to TRIAL_SPACING_MAX times FRESH_STEPS); one within it, after FRESH_STEPS again
FAR_BEHIND = 0.15
TRIAL_SPACING_MAX = 8
OUTDONE_TRIAL_GAP = 128  # weighings (of 8 speculative steps) at a bucket between trials of an outdone, unmeasured depth
RETRIAL_GAP = 16  # weighings where a shorter depth's older times lead the running one's, between two trials of it


def chain_ladder(spec) -> tuple:
    """The chains from one draft up to ``spec`` (a SpecConfig) when ``spec`` is a whole chain (topk 1, num_steps + 1
    tokens), shortest first; otherwise ``spec`` alone (a tree keeps its shape)."""
    if spec.topk != 1 or spec.num_draft_tokens != spec.num_steps + 1:
        return (spec,)
    return tuple(dataclasses.replace(spec, num_steps=d, num_draft_tokens=d + 1) for d in range(1, spec.num_steps + 1))


class ChainDepth:
    def __init__(self, ladder: tuple, window: int = 256, margin: float = 0.03,
                 explore_every: int = 64, recheck_every: int = 8, dwell: int = 3):
        self.ladder = ladder
        self.full = len(ladder)  # depth d is ladder[d - 1]
        self.keep = 1.0 - 1.0 / window
        self.margin, self.explore_every, self.recheck_every, self.dwell = margin, explore_every, recheck_every, dwell
        self._dwelling: dict[int, int] = {}  # bucket -> weighings its depth is still kept after a change
        self._due: dict[int, int] = {}  # bucket -> steps until its depth is weighed again
        self._trials = [0.0] * (self.full + 1)  # by position 1..full (index 0 unused)
        self._accepts = [0.0] * (self.full + 1)
        self._pending: dict[tuple[int, int], int] = {}  # (depth, accepted) -> rounds not folded in yet
        self._chosen: dict[int, int] = {}  # bucket -> depth
        self._short_steps = 0  # speculative steps at a shorter depth since the full one last ran
        self._tried: dict[tuple[int, int], int] = {}  # (bucket, depth) -> trials since its width was last measured
        self._trial: dict[int, tuple[int, int]] = {}  # bucket -> (depth under trial, its steps still to draft)
        self._running: int | None = None  # the depth the last step drafted
        self._running_transient = False  # ... in a trial or an exploring step (not a depth to take up elsewhere)
        self._bucket: int | None = None  # the bucket the last step ran at
        self._steps_here = 0  # speculative steps since the batch came into it
        self._stay: dict[int, float] = {}  # bucket -> speculative steps the batch stays there once it comes in
        self._spacing: dict[tuple[int, int], int] = {}  # (bucket, width) -> FRESH_STEPS times this: when timed again
        # (bucket, depth) of trials whose outcome sets their spacing at the next weighing that measures every depth (one
        # that starts another depth's trial returns before it)
        self._judged: set[tuple[int, int]] = set()
        self._retrial_gap: dict[tuple[int, int], int] = {}  # (bucket, depth) -> weighings before it is timed again
        self._outdone_wait: dict[tuple[int, int], int] = {}  # (bucket, depth) -> weighings before an outdone one's trial

    def observe(self, depth: int, accepted: int) -> None:
        """A round drafted ``depth`` tokens and ``accepted`` of them were kept."""
        key = (depth, accepted)
        self._pending[key] = self._pending.get(key, 0) + 1

    def tokens_per_round(self, depth: int) -> float:
        """Expected tokens a round of a chain of ``depth`` makes (the bonus token included)."""
        self._fold()
        total, reach = 1.0, 1.0
        for i in range(1, depth + 1):
            reach *= (self._accepts[i] + 0.5 * PRIOR_ROUNDS) / (self._trials[i] + PRIOR_ROUNDS)
            total += reach
        return total

    def choose(self, bucket: int, round_time: Callable[[int], float | None]):
        """This step's chain at batch ``bucket``; ``round_time(width)``: seconds a round of that verify width
        costs there (None: not measured; such a depth is not chosen); its ``spread(width)``, where it has one: the
        relative standard error of that."""
        held, spread = self._chosen.get(bucket, self.full), getattr(round_time, "spread", None)
        # The batch just came into this bucket with another depth running (buckets hold their own depths): weighed now,
        # the running depth kept unless this bucket's best beats it by the margin (a batch moving between buckets 4
        # and 8 would otherwise change depth at each crossing, each change ending the queued runs).
        entered = (self._running is not None and not self._running_transient and bucket != self._bucket
                   and held != self._running)
        self._count_stay(bucket)
        trial = self._trial.pop(bucket, None)
        if trial is not None:  # a depth being timed drafts its trial's steps in a row, then the bucket weighs again
            depth, left = trial
            if left > 1:
                self._trial[bucket] = (depth, left - 1)
            self._due[bucket] = 0
            return self._run(depth, transient=True)
        if held < self.full and not entered:
            self._short_steps += 1
            if self._short_steps >= self.explore_every:  # the positions past it are measured again
                self._short_steps = 0
                return self._run(self.full, transient=True)
        due = self._due.get(bucket, 0)
        if due > 0 and not entered:  # (weighed every few steps: acceptance and costs move slowly)
            self._due[bucket] = due - 1
            return self._run(held)
        self._fold()
        if self._trials[1] < MIN_ROUNDS:
            return self._run(self.full)
        self._due[bucket] = self.recheck_every - 1
        rates, outdone = {}, self._outdone(getattr(round_time, "seeded", None))
        for depth in range(1, self.full + 1):
            seconds = round_time(depth + 1)
            if seconds:
                self._tried.pop((bucket, depth), None)
                rates[depth] = self.tokens_per_round(depth) / seconds
            elif depth in outdone and self._outdone_waits(bucket, depth):
                continue
            elif self._tried.get((bucket, depth), 0) < UNMEASURED_TRIALS:  # a trial times it
                self._tried[bucket, depth] = self._tried.get((bucket, depth), 0) + 1
                return self._start_trial(bucket, depth, round_time)
        self._space_trials(bucket, rates)
        incumbent = self._running if entered else held
        if incumbent not in rates:
            best = max(rates, key=rates.get, default=self.full)
        else:
            best = max(rates, key=rates.get)
            dwelling = 0 if entered else self._dwelling.get(bucket, 0)
            if dwelling:
                self._dwelling[bucket] = dwelling - 1
            # a change must pay its price back in the steps the batch is expected to stay in the bucket, and its
            # lead must stand out of the round times' noise
            stay = self._stay.get(bucket)
            margin = self.margin if stay is None else max(self.margin, SWITCH_PRICE_STEPS / stay)
            margin += NOISE_Z * math.hypot(*(spread(d + 1) or 0.0 for d in (best, incumbent))) if spread else 0.0
            if dwelling or rates[best] < rates[incumbent] * (1 + margin):
                best = incumbent
            elif best < incumbent and not getattr(round_time, "recent", lambda width: True)(best + 1):
                # A shorter chain's times older than the running one's: served, step times drift in spells, so it is
                # timed again next to the running depth's latest steps before it is taken (once in RETRIAL_GAP such
                # weighings)
                left = self._retrial_gap.get((bucket, best), 0)
                self._retrial_gap[bucket, best] = left - 1 if left else RETRIAL_GAP
                if not left:
                    return self._start_trial(bucket, best, round_time)
                best = incumbent
        if best != incumbent:  # (an operator sees the policy shorten or lengthen its chains, not every weighing)
            self._dwelling[bucket] = self.dwell
            on = getattr(round_time, "weighed_on", None)
            log.info("batch bucket %d: chains of %d draft%s now (expected tokens a second %s)", bucket, best,
                     "s" if best > 1 else "",
                     ", ".join(f"{d}: {1e-3 * bucket * r:.1f}k ({self.tokens_per_round(d):.2f} a round in "
                               f"{1e3 * self.tokens_per_round(d) / r:.2f} ms" + (f", {on(d + 1)} steps)" if on else ")")
                               for d, r in sorted(rates.items())))
        self._chosen[bucket] = best
        return self._run(best)

    def _outdone(self, seeded) -> set:
        """Depths a longer chain beats by ``margin`` at the warm-up's round times (``seeded(width)``, in process, greedy):
        served alike they can only fall further behind — serving adds to every round what the warm-up did not pay
        (streaming, the GIL, the gateway), about the same whatever the width or in proportion to the tokens a round
        makes, and either favours the chain that makes more tokens a round — so they are not timed while unmeasured,
        but once in ``OUTDONE_TRIAL_GAP`` weighings (sampled traffic and log-probabilities cost a wide verify more than
        the greedy warm-up did). A depth measured served is weighed as any other."""
        if seeded is None:
            return set()
        at_seeds = {}
        for depth in range(1, self.full + 1):
            seconds = seeded(depth + 1)
            if seconds:
                at_seeds[depth] = self.tokens_per_round(depth) / seconds
        return {d for d, rate in at_seeds.items()
                if any(e > d and other >= rate * (1 + self.margin) for e, other in at_seeds.items())}

    def _outdone_waits(self, bucket: int, depth: int) -> bool:
        """Whether an outdone, unmeasured depth at ``bucket`` waits on (True) or is timed by a trial now."""
        left = self._outdone_wait.get((bucket, depth), OUTDONE_TRIAL_GAP)
        self._outdone_wait[bucket, depth] = left - 1 if left > 0 else OUTDONE_TRIAL_GAP
        return left > 0

    def _start_trial(self, bucket: int, depth: int, round_time):
        forget = getattr(round_time, "forget", None)
        if forget is not None:  # (the trial's times alone: what is left of the old ones is as old)
            forget(depth + 1)
        if TRIAL_STEPS > 1:
            self._trial[bucket] = (depth, TRIAL_STEPS - 1)
        self._judged.add((bucket, depth))
        return self._run(depth, transient=True)

    def trial_spacing(self, bucket: int) -> Callable[[int], int]:
        """Width -> timed steps at ``bucket`` after which that width, not served since, is timed again in a trial."""
        return lambda width: FRESH_STEPS * self._spacing.get((bucket, width), 1)

    def _space_trials(self, bucket: int, rates: dict) -> None:
        """Depths just timed by trials: one far behind the best (FAR_BEHIND) is tried next twice as late as last;
        else after FRESH_STEPS (a trial of each shorter depth every few seconds at each bucket changed the depth
        several times a load, each change ending the queued runs)."""
        best = max(rates.values(), default=0.0)
        for depth in [d for b, d in self._judged if b == bucket and d in rates]:
            self._judged.discard((bucket, depth))
            key = (bucket, depth + 1)
            far = rates[depth] * (1 + FAR_BEHIND) < best
            self._spacing[key] = min(TRIAL_SPACING_MAX, 2 * self._spacing.get(key, 1)) if far else 1

    def _count_stay(self, bucket: int) -> None:
        """Speculative steps the batch stays in a bucket once it comes in (decayed mean, by bucket)."""
        if bucket == self._bucket:
            self._steps_here += 1
            return
        if self._bucket is not None:
            old = self._stay.get(self._bucket)
            self._stay[self._bucket] = self._steps_here if old is None else 0.75 * old + 0.25 * self._steps_here
        self._bucket, self._steps_here = bucket, 1

    def _run(self, depth: int, transient: bool = False):
        self._running, self._running_transient = depth, transient
        return self.ladder[depth - 1]

    def chosen_width(self, bucket: int) -> int:
        """The verify width of the depth last chosen at ``bucket`` (the full chain's before any)."""
        return self._chosen.get(bucket, self.full) + 1

    def _fold(self) -> None:
        """Count the rounds observed since the last fold into the shares by position, each position's decayed per
        round that reached it: one a shorter chain does not reach keeps its share until a full-depth step."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        tried, kept = [0] * (self.full + 1), [0] * (self.full + 1)
        for (depth, accepted), count in pending.items():
            for i in range(1, min(accepted + 1, depth) + 1):  # position i was tried when all before it were kept
                tried[i] += count
                kept[i] += count if i <= accepted else 0
        for i in range(1, self.full + 1):
            if tried[i]:  # n rounds at once: the old weight decays by keep^n, theirs sums to (1 - keep^n) / (1 - keep)
                factor = self.keep ** tried[i]
                weight = (1 - factor) / (1 - self.keep)
                self._trials[i] = factor * self._trials[i] + weight
                self._accepts[i] = factor * self._accepts[i] + weight * kept[i] / tried[i]
