"""DrafterAttachment: whether the engine keeps the drafter's input while the batch decodes plainly.

A request stays ready to draft through plain steps only at a price: each step's EAGLE-3 features are
captured and held for its next draft, each prompt's too, and a finishing request's held input goes to the
drafter's prefix cache. On a large target that is about 1 % of a plain step; on a small one at batch it
was 40 % of target-only's speed (the demo pair in process, a drafter attached to a batch that never
speculated: 0.60x at concurrency 8). So once the policy has kept the batch plain for a while (it
measured that speculation does not pay there), the engine *detaches*: every request's draft state is
released and nothing more is captured — plain steps are then target-only steps. Requests prefilled while
detached join the drafter when it attaches again (tandem.engine.draft_link.DraftLink.join_running).

After a detached period the engine attaches again: prompts admitted from then on start on the drafter, and
once the whole batch can draft (``ready_share``; or after ``ready_timeout_s``) the policy is asked again,
so that it measures speculation with the batch it would speculate with, not drafting rows among filler: with
half the batch drafting (the earlier default) a round's tokens were diluted by a third on the demo pair, and the
policy kept concurrency 8 plain where speculating always made 1.49x target-only (docs/benchmarks.md). Each detach doubles the next detached period (up to ``detached_max_s``), so a drafter that never
pays costs a shrinking share of the time — and where measured goodput found plain steps far faster, the next
detached period is long enough that the attached span that measured it again (its ramp, the exploration of
speculation, the plain steps to the verdict), times the share of goodput speculation lost there, is
``remeasure_cost`` of it (a small target at high concurrency loses much of its goodput speculating, and a
re-attach's span is then a large share of a few seconds detached). A batch that speculates in earnest (``detach_after_steps``
speculative steps in a row lasting ``detach_after_s``, not an exploration nor the re-measurement after a
re-attach) starts the backoff over — where measured goodput has it ahead of plain by at least ``earnest_lead``
(or has not measured both): modes about even at a large batch would otherwise attach, measure and detach again
every few seconds, each attached span paying for input no round uses.

Where measured goodput (tandem.speculative.goodput) has found plain steps faster at the running batch size,
the engine detaches after ``detach_measured_steps`` plain decisions instead of the time and steps above — where
speculation loses at least ``detach_measured_loss`` there: the verdict is already measured, and attached plain steps pay
for input no draft will use. A closer verdict waits out the time and steps: at concurrency 1 speculation's reading
follows each prompt's acceptance, and detaching on a hard prompt's small loss ran the next requests plain for seconds
(undrafted: admitted while detached). Where speculation won
only narrowly against attached plain steps and plain was never measured detached there, the engine detaches for
``probe_detached_s`` (a probe) to measure it. And where the running batch falls, while detached, to a batch bucket
whose last measured verdict was speculation (``favoured_attach_s`` in a row; or with no verdict, where the traffic's τ
clears its cost ratio: SpeculationPolicy.speculation_favoured), the engine attaches at once: a light load after a heavy
one does not wait out a detached period meant for the heavy one; and a batch back at a bucket that is not favoured
before that period's end goes back to it at once (``returns_detached``), measuring nothing again there. Idle time does not count
towards a detached period (``idle``) — except a probe's: one taken as the traffic stopped held the next traffic
detached (the demo pair as a service over REST: a probe at batch 1 among the bench's first requests held the
first load at concurrency 1, 40 s later, detached for a quarter of its windows).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class AttachmentConfig:
    # the policy kept the batch plain this long and this many steps (short explorations included): detach;
    # as many speculative steps in a row: speculating in earnest (the clock and the backoff start over)
    detach_after_s: float = 1.0
    detach_after_steps: int = 64
    detach_measured_steps: int = 8  # ... or this many where measured goodput found plain steps faster ...
    detach_measured_loss: float = 0.1  # ... by at least this share of goodput (else the time and steps above)
    detached_first_s: float = 2.0  # the first detached period
    detached_max_s: float = 32.0  # the longest (each period that ends in detaching again doubles the next)
    ready_share: float = 1.0  # attached again: the policy is asked once this share of the batch can draft ...
    ready_timeout_s: float = 2.0  # ... or after this long
    remeasure_cost: float = 0.01  # a re-attach's measured loss: at most about this share of the detached period before it
    probe_detached_s: float = 1.0  # a probe (plain steps measured without the drafter): detached this long
    earnest_lead: float = 0.05  # earnest speculation restarts the backoff only this far ahead of plain (measured)
    favoured_attach_s: float = 0.2  # detached, at a bucket whose verdict was speculation this long: attach at once
    # detached, the engine asks again whether the period ends this often at each batch size: its ends are
    # seconds apart, and asking every step took 18-19 us of host a step on the CPU VM (target-only's decision: ~1.5)
    detached_decided_every_s: float = 0.002


class DrafterAttachment:
    def __init__(self, cfg: AttachmentConfig = AttachmentConfig(), clock=time.perf_counter):
        self.cfg, self.clock = cfg, clock
        self._paused = 0
        self.reset()

    def reset(self) -> None:
        """Attached, nothing counted (a fresh engine, or after the warm-up)."""
        self.detached, self._held, self._probing = False, False, False
        self._plain_since: float | None = None
        self._plain_steps = 0
        self._spec_streak = 0  # consecutive speculative decisions
        self._spec_since: float | None = None  # ... since when
        self._period = self.cfg.detached_first_s
        self._detached_until = 0.0
        self._waiting_since: float | None = None  # attached again, the policy not asked yet
        self._attached_at: float | None = None  # attached again at (None: not since earnest speculation or start)
        self._favoured_since: float | None = None  # detached, at a bucket whose verdict was speculation, since
        self._early_until: float | None = None  # attached by a favoured bucket before this end of its detached period
        self._idle_since: float | None = None  # nothing running since (a detached period stands still)
        self._last_decision: float | None = None  # when after_decision was last called

    def hold_detached(self, as_served: bool = False) -> None:
        """Detached from now on, until ``reset``: plain steps only, whatever the policy says (an engine measured
        as a target-only one: bench/detached_plain.py, the graph tests). The engine must not hold draft state yet.
        ``as_served``: a detached period that never ends, every step decided as while serving (a bucket whose verdict
        favours speculation still attaches)."""
        self.detached, self._held, self._detached_until = True, not as_served, float("inf")

    def idle(self) -> None:
        """Nothing is running: the plain clock starts again with the next traffic (idle time is not plain decoding),
        and a detached period stands still until then (it bounds what measuring again costs as a share of the
        serving between, and idle time serves nothing: loads apart in time would each pay a re-measurement)."""
        self._plain_since, self._plain_steps, self._spec_streak, self._spec_since = None, 0, 0, None
        self._favoured_since = None
        if self._idle_since is None:  # (since the last decision: an engine is not stepped while idle)
            self._idle_since = self.clock() if self._last_decision is None else self._last_decision

    def pause(self) -> None:
        """Until ``resume``: neither detach nor count (the warm-up forces both kinds of step)."""
        self._paused += 1

    def resume(self) -> None:
        self._paused -= 1

    @property
    def attached_early(self) -> bool:
        """Attached by a favoured bucket before its detached period was over (see ``returns_detached``)."""
        return self._early_until is not None and not self.detached

    def returns_detached(self, spec_favoured: bool) -> bool:
        """Attached early by a favoured bucket: whether the batch, now at a bucket that is not favoured before the
        detached period's end, goes back to it at once — asked once a step, before the decision: the step is then
        plain, and ``after_decision(back=True)`` detaches without the speculation a period's end measures again at that
        bucket (a closed loop's batch climbing back to the full bucket measured speculation afresh for about
        goodput_tie_s at every swing: 6-8 % of its goodput, simulated)."""
        if not self.attached_early or self._paused:
            return False
        now = self.clock()
        self._wake(now)
        if now >= self._early_until:
            self._early_until = None  # the period is over: measured as any re-attach is
            return False
        return not spec_favoured

    def policy_may_decide(self, drafting: int, running: int) -> bool:
        """Whether the policy is asked this step. Right after attaching again, not until ``ready_share`` of
        the ``running`` requests can draft (``drafting``) or ``ready_timeout_s`` has passed: the batch
        decodes plainly meanwhile, and those steps count towards nothing."""
        if self._waiting_since is None:
            return True
        if drafting >= self.cfg.ready_share * running or self.clock() - self._waiting_since >= self.cfg.ready_timeout_s:
            self._waiting_since = None
            return True
        return False

    def after_decision(self, speculating: bool, asked: bool, can_switch: bool,
                       plain_measured_faster: bool = False, loss: float = 0.0, probe: bool = False,
                       spec_lead: Callable[[], float | None] = lambda: None,
                       spec_favoured: bool = False, passing: bool = False, back: bool = False) -> str | None:
        """The step's decision is made (``asked``: by the policy; ``can_switch``: no speculative run is in
        flight; ``plain_measured_faster``: measured goodput at this batch size chose plain, speculation losing
        ``loss`` of it; ``probe``: plain steps are to be measured detached, the step made plain by the caller;
        ``spec_lead()``: speculation's measured goodput over plain's at this batch size, less one (None: not both
        measured; asked only once a speculative streak is earnest); ``spec_favoured``: the last verdict measured at this batch size was speculation;
        ``passing``: a plain step the policy takes only to measure plain (an exploration of it, or a step timing it)
        while it keeps speculating: it breaks a speculative streak but does not run the plain clock (a load's first
        explorations at each bucket could add up to the detach clock between short streaks and detach a drafter that
        led); ``back``: ``returns_detached`` sent the batch back to its detached period (the step made plain).
        → "detach", "attach" or None: what the engine does now."""
        if self._paused:
            return None
        now = self.clock()
        self._wake(now)
        self._last_decision = now
        if back and can_switch and self.attached_early:  # (returns_detached said so: the period it cut short)
            self.detached, self._probing, self._detached_until, self._early_until = True, False, self._early_until, None
            self._plain_since, self._plain_steps = None, 0
            return "detach"
        if probe and asked and can_switch and not self.detached:  # (the backoff and the clocks untouched)
            self.detached, self._probing, self._detached_until = True, True, now + self.cfg.probe_detached_s
            return "detach"
        if self.detached:
            if self._held or (now < self._detached_until
                              and (self._probing or not self._favoured_long_enough(spec_favoured, now))):
                return None
            self._early_until = self._detached_until if now < self._detached_until else None
            self.detached, self._waiting_since, self._attached_at, self._favoured_since = False, now, now, None
            self._plain_since, self._plain_steps = None, 0
            return "attach"
        if not asked:
            return None
        c = self.cfg
        if speculating:
            # Speculating in earnest (not a short exploration): the plain clock starts over; and the backoff, once
            # it has lasted as long as a detach takes (not goodput measuring speculation again after a re-attach:
            # an epoch of goodput_epoch_s is more than detach_after_steps rounds of a small target).
            if self._spec_streak == 0:
                self._spec_since = now
            self._spec_streak += 1
            if self._spec_streak >= c.detach_after_steps:
                self._plain_since, self._plain_steps = None, 0
                started_over = self._period == c.detached_first_s and self._attached_at is None
                if now - self._spec_since >= c.detach_after_s and not started_over:
                    lead = spec_lead()
                    if lead is None or lead >= c.earnest_lead:
                        self._period, self._attached_at = c.detached_first_s, None
            return None
        self._spec_streak = 0
        if passing:
            return None
        if self._plain_since is None:
            self._plain_since = now
        self._plain_steps += 1
        settled = (self._plain_steps >= c.detach_measured_steps if plain_measured_faster and loss >= c.detach_measured_loss
                   else now - self._plain_since >= c.detach_after_s and self._plain_steps >= c.detach_after_steps)
        if can_switch and settled:
            remeasured = 0.0 if self._attached_at is None or not plain_measured_faster else now - self._attached_at
            period = min(max(self._period, remeasured * loss / c.remeasure_cost), c.detached_max_s)
            self.detached, self._probing, self._detached_until = True, False, now + period
            self._period = min(2 * period, c.detached_max_s)
            return "detach"
        return None

    def _wake(self, now: float) -> None:
        """Traffic again after idle time: the detached period resumes where it stood (and the one an early attach cut
        short) — unless a probe's: it measures now, or it ends (the next traffic drafts)."""
        if self._idle_since is None:
            return
        if not self._probing:
            self._detached_until += now - self._idle_since
            if self._early_until is not None:
                self._early_until += now - self._idle_since
        self._idle_since = None

    def _favoured_long_enough(self, spec_favoured: bool, now: float) -> bool:
        """Detached: whether the batch has run ``favoured_attach_s`` at buckets whose verdict was speculation."""
        if not spec_favoured:
            self._favoured_since = None
            return False
        if self._favoured_since is None:
            self._favoured_since = now
        return now - self._favoured_since >= self.cfg.favoured_attach_s
