"""GoodputArbiter: speculate or not by the tokens per second each way has measured, whatever the cause.

The cost model (tandem.speculative.policy) predicts from step times and acceptance; under load it misses
what a served engine pays around the steps: prompts that arrive (prefilled apart, extended into the drafter
only while speculating), runs of queued steps cut short by them, held features, catch-ups when speculation
resumes, the per-step streaming of a server. So the engine also reports every step it runs with requests
running as (batch size, mode, tokens emitted, wall seconds to the next step) — of a step of prompts alone only its
extension of the prompts into the drafter, as speculative seconds (the prefill is paid either way:
tandem.engine.step_accounting) — and this keeps, per batch bucket and mode, the decayed tokens over seconds: the
goodput each way.

Until both modes have been measured at a batch bucket, the cost model decides, step by step, and the mode it
rejects is measured in an epoch of its own once the loss the model predicts for it allows (as below). Then
this decides, in epochs (at least ``goodput_epoch_steps`` steps and ``goodput_epoch_s`` seconds of one mode,
so that a switch's cost is spread over enough steps to be measured with them; an exploration:
``goodput_explore_steps`` steps and as many seconds): the
faster one runs, held unless the other is ahead by ``goodput_margin``, and the slower one gets an epoch again
once what that epoch lost (its length times the share of goodput the slower mode gives up) is
``goodput_explore_cost`` of the served time since (idle left out; at most ``goodput_explore_max_s`` later): a mode
far behind is measured rarely, modes about even often — which is where load or text can tip them.

Plain steps run with the drafter detached (tandem.speculative.attachment) are metered apart: they are what
plain decoding costs once the policy has settled on it, so where they have been measured they are plain's
goodput — unless plain steps run attached since then measured faster. A detached reading cannot be refreshed
while attached (every plain step then, an exploration's too, feeds the attached meter), so one read low (a wave's
ramp through the bucket meters its prompt steps too) would hold speculation until it went stale; attached plain
steps measured slower do not replace it, since they pay for input no draft uses. ``verdict`` says which mode
measured faster, for the engine to detach at once on a plain one. Speculation cannot be measured while detached,
so a detached period forgets its goodput and it is measured afresh, at once, after the re-attach: a reading kept
from before (low early, a wave's prompt steps metered with it) would detach again after a few plain steps, an
exploration then too short to move a decayed meter, or not due at all where an epoch spanned the detached period.
Measured afresh, speculation is called slower only once it has ``goodput_tie_s`` (decayed seconds) of steps, unless
plain is ahead by ``TIE_LEAD``: a short reading is a few requests' texts, and their rounds are alike (the demo pair as a
service at concurrency 1 read 2995 tok/s against plain's 3165 a quarter second after a re-attach, 3775 over the second
before it, and detached again for twice as long).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


DETACHED = "detached"  # the meter key of plain steps with the drafter detached
BUCKET_REACH = 1.25  # a bucket keeps a batch this far past its edge (StickyBuckets)
TIE_LEAD = 1.5  # plain ahead of speculation measured afresh by less than this factor: measured on (goodput_tie_s)


@dataclass
class _Meter:
    """One mode's goodput at one batch bucket: tokens and seconds, both decayed by the seconds measured since."""

    tokens: float = 0.0
    seconds: float = 0.0
    last: float = -math.inf  # when it was last measured, in served seconds (GoodputArbiter.served_s) ...
    last_at: float = -math.inf  # ... and on the clock
    tokenless: float = 0.0  # of ``seconds``, those of steps that emitted nothing (speculation's prompt extensions)

    def add(self, tokens: int, seconds: float, window_s: float, served: float, now: float) -> None:
        keep = math.exp(-seconds / window_s)
        self.tokens, self.seconds, self.last = keep * self.tokens + tokens, keep * self.seconds + seconds, served
        self.last_at = now
        self.tokenless = keep * self.tokenless + (0.0 if tokens else seconds)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class StickyBuckets:
    """Batch size -> bucket (``bucket``: powers of two, each batch to the nearest), except that the bucket the batch
    was last served at keeps it ``reach`` times past its edge: a load whose batch moves about an edge (requests ending
    and arriving) would be measured, explored and probed as two loads, each at half the readings."""

    def __init__(self, bucket, reach: float = BUCKET_REACH):
        self._bucket, self._reach = bucket, reach * math.sqrt(2)
        self.current: int | None = None  # the bucket of the latest step observed

    def __call__(self, batch_size: int) -> int:
        b, held = self._bucket(batch_size), self.current
        if held is not None and b != held and held / self._reach <= batch_size <= held * self._reach:
            return held
        return b

    def track(self, batch_size: int) -> None:
        """A step was served at ``batch_size``."""
        self.current = self(batch_size)


class GoodputArbiter:
    def __init__(self, cfg, bucket, clock=time.perf_counter, switch_cost=lambda bucket: 0.0):
        """``cfg``: the PolicyConfig (its ``goodput_*`` fields); ``bucket``: batch size -> bucket (kept with
        hysteresis: StickyBuckets); ``switch_cost``: bucket -> seconds an exploration pays to switch and back beyond
        its steps (the drafter's catch-up)."""
        self.cfg, self.bucket, self.clock, self.switch_cost = cfg, StickyBuckets(bucket), clock, switch_cost
        self._meters: dict[tuple[int, bool | str], _Meter] = {}  # (bucket, True / False / DETACHED)
        self._epoch_start = 0.0
        self._epoch_bucket = 0  # the bucket the current epoch began at (an exploration is scheduled there)
        self._detached = False  # the latest step observed was a detached one
        self._probed_at = -math.inf  # ``served_s`` when the latest probe was taken, at whichever bucket (take_probe)
        self.served_s = 0.0  # seconds of steps observed (time with requests running: idle time left out)
        self.forget_traffic()  # (what follows from speculation's goodput: none yet)

    def observe(self, batch_size: int, speculative: bool, tokens: int, seconds: float, detached: bool = False) -> None:
        """A step with ``batch_size`` requests running, in that mode, emitted ``tokens`` in ``seconds``;
        ``detached``: a plain step with the drafter detached."""
        self.observe_steps(batch_size, speculative, ((tokens, seconds),), detached)

    def observe_steps(self, batch_size: int, speculative: bool, steps, detached: bool = False) -> None:
        """``observe`` for steps of one kind in a row at one batch size, ``steps`` their ``(tokens, seconds)`` oldest
        first (each read on the meter as it was added, the clock once)."""
        steps = [(tokens, seconds) for tokens, seconds in steps if seconds > 0]
        if not steps:
            return
        self.bucket.track(batch_size)
        key = DETACHED if detached and not speculative else speculative
        if key == DETACHED and not self._detached:  # a detached period starts: speculation is measured again after it
            forgotten = {k[0] for k in self._meters if k[1] is True}
            self._meters = {k: m for k, m in self._meters.items() if k[1] is not True}
            # ... at once, whichever mode the cost model prefers (where it prefers plain, its settled verdict would
            # detach again before an exploration scheduled before the detached period came due); that measurement
            # is the exploration, not one more on top of it
            self._next_explore = {b: t for b, t in self._next_explore.items() if b not in forgotten}
            self._due.update(forgotten)
            self._afresh.update(forgotten)
        self._detached = key == DETACHED
        at = (self.bucket(batch_size), key)
        meter = self._meters.get(at) or self._meters.setdefault(at, _Meter())  # (get first: this runs every step)
        now, window = self.clock(), self.cfg.goodput_window_s
        for tokens, seconds in steps:
            self.served_s += seconds
            meter.add(tokens, seconds, window, self.served_s, now)
        if speculative == self._mode:
            self._epoch_steps += len(steps)

    def choose(self, batch_size: int, model_says: bool, predicted_loss, rounds_can_pay: bool = True) -> bool:
        """This step's mode: the current epoch's, or at an epoch's end the next one's (see the module).
        ``model_says``: the cost model's choice; ``predicted_loss()``: the share of goodput it expects the other
        mode to lose (how soon that one is measured where it has not been; asked only then: it walks the batch);
        ``rounds_can_pay``: False where the drafting requests' rounds make about one token each (no round can beat a
        plain step, which makes that token for less), so the first epoch of speculation is not hastened."""
        c, now = self.cfg, self.served_s  # (epochs are served time too: one spanning a pause is not over for it)
        steps = c.goodput_explore_steps if self._exploring else c.goodput_epoch_steps
        b, e = self.bucket(batch_size), self._epoch_bucket
        if self._mode is not None and (self._epoch_steps < steps or now - self._epoch_start < c.goodput_epoch_s
                                       or (self._exploring and not self._fresh(self._meters.get((e, self._mode)))
                                           and now - self._epoch_start < 4 * c.goodput_epoch_s)):
            # (an exploration lasts until its mode is measured — its decayed seconds reach goodput_min_s — on the
            # meter it feeds: plain explores attached, whatever a detached period measured)
            return self._mode
        if self._exploring:  # the other mode had its epoch (at the bucket it began at, wherever the batch is now):
            # again once that epoch's loss is a small share
            self._next_explore[e] = self.served_s + self._explore_gap(e, now - self._epoch_start, self._loss(e),
                                                                      self._mode)
        self._mode, self._exploring, self.basis = None, False, "model"
        if not self._measured(b, model_says):
            return model_says  # step by step, measured as it goes
        if not self._measured(b, not model_says):  # the other mode: an epoch once its predicted loss allows
            if b in self._due:  # speculation forgotten by a detached period: its epoch now
                self._due.discard(b)
                self._next_explore[b] = self.served_s
            if b not in self._next_explore:  # the first at this bucket: soon, the model's prediction is no measurement
                gap = self._explore_gap(b, c.goodput_epoch_s, predicted_loss())
                soon = rounds_can_pay or model_says  # (plain rejected: its first epoch is soon whatever τ is)
                self._next_explore[b] = self.served_s + (min(gap, c.goodput_first_explore_s) if soon else gap)
            if self.served_s < self._next_explore[b]:
                return model_says
            mode, self._exploring = not model_says, True
        else:  # (speculation measured again after a detached period, step by step: that was the exploration due)
            self._due.discard(b)
            mode, self._exploring = self._pick(b, model_says)
        self._mode, self._epoch_start, self._epoch_steps, self._epoch_bucket = mode, now, 0, b
        self.basis = "exploring" if self._exploring else "measured"
        return mode

    def forget_traffic(self) -> None:
        """New traffic: speculation's goodput was its acceptance, so it is measured afresh (and every verdict and
        schedule built on it goes); plain steps' goodput is a cost, kept until it goes stale like any reading."""
        self._meters = {k: m for k, m in self._meters.items() if k[1] is not True}
        self._mode: bool | None = None  # the current epoch's mode
        self.basis = "model"  # what the latest choice rested on: the model's answer, a measured epoch, an exploration
        self._epoch_steps, self._exploring = 0, False
        self._best: dict[int, bool] = {}  # bucket -> the mode measured faster (with hysteresis)
        # bucket -> when the slower mode is measured again, in served seconds (``served_s``: idle time costs no
        # goodput, and loads seconds apart each explored at their start)
        self._next_explore: dict[int, float] = {}
        self._due: set[int] = set()  # buckets whose speculative goodput a detached period forgot: measured at once
        self._afresh: set[int] = set()  # ... and not called since (see the module: goodput_tie_s)

    def verdict(self, batch_size: int) -> bool | None:
        """The mode measured faster at ``batch_size``'s bucket (both measured), or None; an exploration of the
        slower mode does not change it."""
        b = self.bucket(batch_size)
        if b not in self._best or not (self._measured(b, True) and self._measured(b, False)):
            return None
        return self._best[b]

    def has_verdict(self, batch_size: int) -> bool:
        """Whether a verdict was ever reached at ``batch_size``'s bucket (both modes measured), since this traffic."""
        return self.bucket(batch_size) in self._best

    def favours_speculation(self, batch_size: int) -> bool:
        """Whether the last verdict at ``batch_size``'s bucket, both modes measured then, was speculation (however
        long ago: a detached period forgets speculation's goodput, not this)."""
        return self._best.get(self.bucket(batch_size)) is True

    def take_probe(self, batch_size: int, ships_features: bool = True, tax: float | None = None) -> bool:
        """Whether the engine is to detach briefly now (a probe; then taken: at most one probe in ``goodput_stale_s``
        of serving, whatever the bucket — idle time left out, or loads seconds apart would each pay a probe; and a
        batch about a bucket's edge paid one at either bucket, each a second detached, its admitted requests undrafted
        until they join the drafter after it):
        speculation won at ``batch_size``'s bucket only against plain steps run attached, by less than
        ``goodput_probe_margin``, plain not measured detached there. Attached, plain steps pay for input no
        draft may use (a service drafter: the features shipped every step), so detached ones may be faster than
        speculation, which only detaching can measure. Where they only hold the features (``ships_features`` False: an
        in-process head) that price is small, and a probe costs more than it can find — the requests admitted while
        detached draft only once they join the drafter after it, from rebuilt entries —, so none is taken unless attached plain steps were timed to cost
        ``goodput_margin`` more: at concurrency 1 speculation's reading follows each prompt's acceptance, and a margin
        of a few percent probed on a hard prompt and left the next requests undrafted. ``tax``: what attached plain
        steps were timed to cost over
        detached ones at this bucket, less one (the warm-up's): speculation ahead of attached plain steps by less than
        that (and ``goodput_margin``) may be behind detached ones, up to ``goodput_probe_margin_max``."""
        b, c = self.bucket(batch_size), self.cfg
        if not ships_features and (tax is None or tax < c.goodput_margin):
            return False
        margin = c.goodput_probe_margin if ships_features else 0.0
        if tax is not None:
            margin = max(margin, min(c.goodput_probe_margin_max, tax + c.goodput_margin))
        spec, attached = self._meters.get((b, True)), self._meters.get((b, False))
        if (self.served_s - self._probed_at < c.goodput_stale_s or self.verdict(batch_size) is not True
                or self._fresh_detached(self._meters.get((b, DETACHED))) or not self._fresh(attached)
                or spec.rate >= attached.rate * (1 + margin)):
            return False
        self._probed_at = self.served_s
        return True

    def loss(self, batch_size: int) -> float:
        """The share of goodput the slower mode loses at ``batch_size``'s bucket, as measured (1.0 until both are)."""
        return self._loss(self.bucket(batch_size))

    def rates(self, batch_size: int) -> tuple[float | None, float | None]:
        """(speculative, plain) goodput in tokens/s at ``batch_size``'s bucket where measured, else None."""
        b = self.bucket(batch_size)
        return tuple(self._meter(b, mode).rate if self._measured(b, mode) else None for mode in (True, False))

    def tokenless_share(self, batch_size: int) -> float | None:
        """The share of speculation's measured seconds at ``batch_size``'s bucket that emitted nothing (its prompt
        extensions), where it is measured (for the log)."""
        b = self.bucket(batch_size)
        if not self._measured(b, True):
            return None
        meter = self._meter(b, True)
        return meter.tokenless / meter.seconds

    def _meter(self, b: int, mode: bool) -> "_Meter | None":
        """Mode ``mode``'s meter at bucket ``b``; plain's: the detached steps' where they are measured, unless
        plain steps run attached since measured faster (see the module: a detached reading is frozen while
        attached)."""
        attached = self._meters.get((b, mode))
        if not mode:
            detached = self._meters.get((b, DETACHED))
            if self._fresh_detached(detached) and not (self._fresh(attached) and attached.last > detached.last
                                                            and attached.rate > detached.rate):
                return detached
        return attached

    def _fresh(self, meter: "_Meter | None") -> bool:
        """Measured for ``goodput_min_s`` (decayed), the latest less than ``goodput_stale_s`` ago in served time: idle
        time does not age a reading (a load resuming after a pause is the load it was; measured afresh, each request
        after a pause of interactive traffic paid an exploration of the slower mode)."""
        return (meter is not None and meter.seconds >= self.cfg.goodput_min_s
                and self.served_s - meter.last < self.cfg.goodput_stale_s)

    def _fresh_detached(self, meter: "_Meter | None") -> bool:
        """A detached reading speaks for plain only ``goodput_detached_stale_s`` after its last step (on the clock, idle
        time included: the host drifts whether it serves or not): it is frozen
        while attached, and compared with speculation measured now, a reading from a faster stretch of a drifting
        host detached the drafter on a tie (the demo pair over REST at concurrency 1); past it, plain is what attached
        plain steps measure, and a probe may measure it detached again."""
        return self._fresh(meter) and self.clock() - meter.last_at < self.cfg.goodput_detached_stale_s

    def _explore_gap(self, b: int, epoch_s: float, loss: float, explored: bool | None = None) -> float:
        """Seconds until the slower mode's next epoch at bucket ``b``: what one costs — its loss over ``epoch_s``, and
        the switch (modes about even lose little per step, but every switch back to speculation catches the drafter up
        over the whole batch, which goodput leaves out) — as ``goodput_explore_cost`` of the time between.
        ``explored``: the slower mode (None: not known). Plain steps behind by ``goodput_close`` or more are only
        measured again every ``goodput_explore_max_s``: their goodput is a cost that moves with the load, while
        speculation's, which moves with the text, is measured all along as it runs — should it fall near plain's
        reading, the gap is the cost's again (every switch back to speculation also breaks runs and catches the drafter
        up, which served costs more than the formula charges)."""
        c = self.cfg
        if explored is False and loss >= c.goodput_close:
            return c.goodput_explore_max_s
        cost = epoch_s * max(0.02, loss) + self.switch_cost(b)
        return min(c.goodput_explore_max_s, cost / c.goodput_explore_cost)

    def _loss(self, b: int) -> float:
        """The share of goodput the slower mode loses at bucket ``b``, as measured."""
        rates = [m.rate for m in (self._meter(b, mode) for mode in (True, False)) if m is not None]
        return 1.0 if len(rates) < 2 or max(rates) <= 0 else 1 - min(rates) / max(rates)

    def _measured(self, b: int, mode: bool) -> bool:
        return self._fresh(self._meter(b, mode))

    def _pick(self, b: int, model_says: bool) -> tuple[bool, bool]:
        """Both modes measured at ``b`` → (mode, whether it is an exploration of the slower one)."""
        spec, plain = self._meter(b, True).rate, self._meter(b, False).rate
        held, margin = self._best.get(b, model_says), 1 + self.cfg.goodput_margin
        best = (plain <= spec * margin) if held else (spec > plain * margin)
        if b in self._afresh and self._meter(b, True).seconds < self.cfg.goodput_tie_s:
            if not best and spec * TIE_LEAD >= plain:
                return True, False  # (measured afresh, and briefly: on, see the module)
        else:
            self._afresh.discard(b)
        self._best[b] = best
        if b not in self._next_explore:  # (the gap walks the meters: reckoned once, not at every choice)
            self._next_explore[b] = self.served_s + self._explore_gap(b, self.cfg.goodput_epoch_s, self._loss(b),
                                                                      not best)
        if self.served_s >= self._next_explore[b]:
            return not best, True
        return best, False
