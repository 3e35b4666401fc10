"""SpeculationPolicy: speculate for a request only while it pays (DESIGN §1: "including off").

A speculative round costs more than a plain decode step (drafting, a wider verify, the drafter's
extension). It pays when the request's tokens per round (accept length τ, bonus included) exceed that
cost ratio. The policy keeps, for the engine, the median wall time of recent plain and of recent
speculative steps, and an estimate of τ per request; a request whose estimate falls below the measured
ratio decodes plainly, and now and then it speculates once (a probe) to see whether the text got easier.

One round's token count is a noisy sample of τ (on the demo pair, rounds of 1 to 6 tokens around a
mean of 3.7), so a request is switched off only when its τ is below the ratio *beyond doubt*: its mean
plus ``confidence_z`` standard errors. The mean and the spread are over the request's recent tokens
(decayed per token over ``request_window_tokens``, speculative or plain, so that old rounds fade while
a request decodes plainly and a probe then speaks for the text as it is now); the spread is shrunk
towards the engine's (as if that were ``variance_prior_rounds`` rounds of the request's own) so that
two or three rounds cannot look certain. A request that pays nothing (rounds of one token, little
spread) goes off within a few rounds; a paying one whose rounds scatter is not switched off by a few
short ones. A probe (below) that pays for its round starts the request's record afresh, so a request
whose text got easier comes back at once. (Before: a moving average with weight 0.3 on the newest
round switched paying requests off, and with the engine-wide average as noisy, started every new
request plainly: on the demo pair on an H200 the serving policy made 1552 tok/s where target-only made
1745 and speculating always 2197.)

While every request speculates no plain step is ever timed, and on a target so small or fast that a
round's fixed costs dominate, speculation would lose without the policy noticing. So the engine runs
one *plain probe step* (no request speculates) as soon as the warm-up is over and t_plain is unknown,
and then every ``plain_probe_every`` speculative steps to keep t_plain current.

Finding out costs more the more a round costs, and is less likely to pay off: probes come every
``probe_every x ratio²`` plain rounds (a probe costs about ``ratio - 1`` plain steps plus the drafter's
catch-up, and the further τ must rise to pay, the rarer it does), and once the engine knows that
speculation does not pay on its traffic (its average τ over recent rounds is below the measured
ratio by two standard errors), new requests skip the warm-up and start with speculation off — the engine then does not even
hand their prompt to the drafter until they probe — learning their own τ at their probes, except
every ``explore_every x ceil(ratio)``-th, which warms up as usual so that a better head (a reload) or
easier traffic is noticed. (On a tiny target on a GPU, where a round costs ~6 plain steps, the
earlier rates — probes every 16 x ratio rounds, every 8th request exploring — cost 13-26 % of
target-only speed on the demo pairs.)
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyConfig:
    enabled: bool = True
    warmup_rounds: int = 4  # speculative rounds of a request before it is judged
    probe_every: int = 16  # plain rounds between two probing speculative rounds, times the cost ratio squared
    request_window_tokens: int = 128  # a request's τ and spread: over about its latest this many tokens
    variance_prior_rounds: float = 2.0  # the engine's spread of τ counts as this many rounds of the request's
    confidence_z: float = 1.0  # off only when τ + z standard errors is below the cost ratio
    engine_window: int = 256  # rounds: the engine's mean τ (all requests) decays over about this many
    default_cost_ratio: float = 1.3  # t(speculative step) / t(plain step) until both are measured
    fixed_cost_ratio: float | None = None  # use this ratio instead of measuring (tests, known hardware)
    plain_probe_every: int = 64  # speculative steps between two plain steps that re-time t_plain
    explore_every: int = 8  # when speculation does not pay, every (8 x ceil(ratio))-th new request warms up anyway


@dataclass
class RequestSpecState:
    rounds: int = 0
    recent: "_DecayedMean | None" = None  # its rounds' token counts, decayed per token it decodes
    probing: bool = False  # this step's round is a probe of a request that was off
    plain_since_probe: int = 0
    speculate_now: bool = True
    skip_warmup: bool | None = None  # decided at its first step: it arrived when speculation did not pay


class SpeculationPolicy:
    def __init__(self, cfg: PolicyConfig = PolicyConfig()):
        self.cfg = cfg
        # Step times: the median of the latest samples, so that one slow step (a graph's first launch,
        # a garbage collection) cannot flip the decision for a long stretch.
        self._plain_times: deque[float] = deque(maxlen=9)
        self._spec_times: deque[float] = deque(maxlen=9)
        self.spec_steps_since_plain = 0
        self.plain_probe = False  # this step runs plain for every request (set by begin_step)
        self._all = _DecayedMean(cfg.engine_window)  # τ over every request's rounds
        self.rounds_all = 0
        self.arrivals = 0
        # The step's cost ratio and whether it is measured, refreshed by begin_step: decide runs per
        # request per step and must not take medians each time.
        self._ratio, self._ratio_known = self.cost_ratio, cfg.fixed_cost_ratio is not None

    @property
    def t_plain(self) -> float | None:
        return statistics.median(self._plain_times) if self._plain_times else None

    @property
    def t_spec(self) -> float | None:
        return statistics.median(self._spec_times) if self._spec_times else None

    @property
    def cost_ratio(self) -> float:
        if self.cfg.fixed_cost_ratio is not None:
            return self.cfg.fixed_cost_ratio
        if self.t_plain is None or self.t_spec is None:
            return self.cfg.default_cost_ratio
        return self.t_spec / self.t_plain

    def begin_step(self) -> None:
        """Called once per engine step before ``decide``: is this a plain probe step?"""
        c = self.cfg
        self._ratio = self.cost_ratio
        self._ratio_known = c.fixed_cost_ratio is not None or (self.t_plain is not None and self.t_spec is not None)
        if not c.enabled or c.fixed_cost_ratio is not None:
            self.plain_probe = False
        elif self.t_plain is None:
            self.plain_probe = self.spec_steps_since_plain >= c.warmup_rounds
        else:
            self.plain_probe = self.spec_steps_since_plain >= c.plain_probe_every
        if self.plain_probe:  # one probe per period, timed or not (a step with a prefill is not timed)
            self.spec_steps_since_plain = 0

    def decide(self, state: RequestSpecState) -> bool:
        """Whether the request speculates this step (called once per step, before scheduling)."""
        c = self.cfg
        if self.plain_probe:  # the probe times a plain step; the request's own schedule is untouched
            state.speculate_now = False
            return False
        ratio = self._ratio
        warming = state.rounds < c.warmup_rounds and not self.starts_plain(state)
        worth = warming or self._may_pay(state, ratio)
        if not c.enabled or worth:
            state.speculate_now, state.plain_since_probe = True, 0
        elif state.plain_since_probe >= math.ceil(c.probe_every * max(1.0, ratio) ** 2):
            state.speculate_now, state.plain_since_probe = True, 0  # probe: is it worth it again?
            state.probing = True
        else:
            state.speculate_now = False
            state.plain_since_probe += 1
            if state.recent is not None:
                state.recent.decay(1)  # a plain step's token: the rounds before it age
        return state.speculate_now

    def _may_pay(self, state: RequestSpecState, ratio: float) -> bool:
        """The request's τ is not below the ratio beyond doubt (mean + z standard errors)."""
        recent = state.recent
        if recent is None or not recent.weight:
            return False  # judged with no round of its own (it started plainly): its probes decide
        mean = recent.mean
        k, engine_variance = self.cfg.variance_prior_rounds, self._all.variance
        variance = (recent.weight * recent.variance + k * engine_variance) / (recent.weight + k)
        return mean + self.cfg.confidence_z * math.sqrt(variance / recent.weight) >= ratio

    def starts_plain(self, state: RequestSpecState) -> bool:
        """Whether a new request skips the warm-up (decided once, at its prefill or first decision):
        speculation is known not to pay here, so it speculates at its probes only, until its own τ says
        otherwise — except some new requests, which explore (a new head, easier text)."""
        if state.skip_warmup is None:
            if not self.cfg.enabled:
                state.skip_warmup = False
            else:
                self.arrivals += 1
                explore_every = self.cfg.explore_every * math.ceil(max(1.0, self._ratio))
                state.skip_warmup = self._known_not_to_pay() and self.arrivals % explore_every != 0
        return state.skip_warmup

    def observe_round(self, state: RequestSpecState, tokens: int) -> None:
        """A speculative round of the request emitted ``tokens`` (accepted drafts + bonus)."""
        state.rounds += 1
        if state.probing:
            state.probing = False
            if tokens >= self._ratio:  # the text may have changed: judge it afresh, from this round on
                state.recent = None
        if state.recent is None:
            state.recent = _DecayedMean(self.cfg.request_window_tokens)
        state.recent.decay(tokens)  # decayed per token: a round of 5 ages the past as 5 plain steps do
        state.recent.add(tokens)
        self._all.decay(1)
        self._all.add(tokens)
        self.rounds_all += 1

    @property
    def tau_all(self) -> float | None:
        """The engine's mean tokens per round over its recent rounds (every request's)."""
        return self._all.mean

    def _known_not_to_pay(self) -> bool:
        """Enough rounds seen (twice a warm-up's worth) with the ratio known, and τ below it beyond doubt:
        its mean plus two standard errors. (On the mean alone, the first rounds' bad luck started every
        later request plainly, and those made too few rounds to correct it.)"""
        return (self._ratio_known and self.rounds_all >= max(1, 2 * self.cfg.warmup_rounds)
                and self._all.upper_bound() < self._ratio)

    def observe_step(self, seconds: float, speculative: bool) -> None:
        """Wall time of a decode-only step, with (``speculative``) or without any draft tree."""
        if speculative:
            self._spec_times.append(seconds)
            self.spec_steps_since_plain += 1
        else:
            self._plain_times.append(seconds)
            self.spec_steps_since_plain = 0


def _keep(window: int) -> float:
    """Per-sample decay of a mean over about ``window`` samples (1: the latest alone)."""
    return 1.0 - 1.0 / max(1, window)


class _DecayedMean:
    """Mean and variance of samples whose weights decay (``decay``) as they age."""

    def __init__(self, window: int):
        self.keep, self.total, self.squares, self.weight = _keep(window), 0.0, 0.0, 0.0

    def decay(self, ages: int) -> None:
        factor = self.keep ** ages
        self.total, self.squares, self.weight = factor * self.total, factor * self.squares, factor * self.weight

    def add(self, value: float) -> None:
        self.total += value
        self.squares += value * value
        self.weight += 1.0

    @property
    def mean(self) -> float | None:
        return self.total / self.weight if self.weight else None

    @property
    def variance(self) -> float:
        if not self.weight:
            return 0.0
        mean = self.total / self.weight
        return max(0.0, self.squares / self.weight - mean * mean)

    def upper_bound(self, z: float = 2.0) -> float:
        """The mean plus z standard errors (the weight standing for the number of samples)."""
        return self.total / self.weight + z * math.sqrt(self.variance / self.weight)
