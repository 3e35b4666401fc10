"""SpeculationPolicy: speculate for a request only while it pays (DESIGN §1: "including off").

A speculative round costs more than a plain decode step (drafting, a wider verify, the drafter's
extension). It pays when the request's tokens per round (accept length τ, bonus included) exceed that
cost ratio. The policy keeps, per request, a moving average of τ over its speculative rounds, and for
the engine the median wall time of recent plain and of recent speculative steps; a request whose τ falls
below the measured ratio decodes plainly, and now and then it speculates once (a probe) to see whether
the text got easier. The drafter catches up on the plain rounds in one extend before the request's next
draft, so a request can resume at any step. Until both kinds of step have been timed the ratio is
``default_cost_ratio``.

While every request speculates no plain step is ever timed, and on a target so small or fast that a
round's fixed costs dominate, speculation would lose without the policy noticing. So the engine runs
one *plain probe step* (no request speculates) as soon as the warm-up is over and t_plain is unknown,
and then every ``plain_probe_every`` speculative steps to keep t_plain current.

Finding out costs more the more a round costs, and is less likely to pay off: probes come every
``probe_every x ratio²`` plain rounds (a probe costs about ``ratio - 1`` plain steps plus the drafter's
catch-up, and the further τ must rise to pay, the rarer it does), and once the engine knows that
speculation does not pay on its traffic (its average τ over recent rounds is below the measured
ratio), new requests skip the warm-up and start with speculation off — the engine then does not even
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
    smoothing: float = 0.3  # weight of the newest round in the moving averages of τ
    default_cost_ratio: float = 1.3  # t(speculative step) / t(plain step) until both are measured
    fixed_cost_ratio: float | None = None  # use this ratio instead of measuring (tests, known hardware)
    plain_probe_every: int = 64  # speculative steps between two plain steps that re-time t_plain
    explore_every: int = 8  # when speculation does not pay, every (8 x ceil(ratio))-th new request warms up anyway


@dataclass
class RequestSpecState:
    rounds: int = 0
    tau: float | None = None  # moving average of tokens per speculative round
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
        self.tau_all: float | None = None  # moving average of τ over every request's rounds
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
        worth = warming or (state.tau is not None and state.tau >= ratio)
        if not c.enabled or worth:
            state.speculate_now, state.plain_since_probe = True, 0
        elif state.plain_since_probe >= math.ceil(c.probe_every * max(1.0, ratio) ** 2):
            state.speculate_now, state.plain_since_probe = True, 0  # probe: is it worth it again?
        else:
            state.speculate_now = False
            state.plain_since_probe += 1
        return state.speculate_now

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
        state.tau = tokens if state.tau is None else self._mix(state.tau, tokens)
        self.tau_all = tokens if self.tau_all is None else self._mix(self.tau_all, tokens)
        self.rounds_all += 1

    def _known_not_to_pay(self) -> bool:
        """Enough rounds seen (twice a warm-up's worth) with the ratio known, and τ below it."""
        return (self._ratio_known and self.rounds_all >= max(1, 2 * self.cfg.warmup_rounds)
                and self.tau_all < self._ratio)

    def observe_step(self, seconds: float, speculative: bool) -> None:
        """Wall time of a decode-only step, with (``speculative``) or without any draft tree."""
        if speculative:
            self._spec_times.append(seconds)
            self.spec_steps_since_plain += 1
        else:
            self._plain_times.append(seconds)
            self.spec_steps_since_plain = 0

    def _mix(self, old: float, new: float) -> float:
        return (1 - self.cfg.smoothing) * old + self.cfg.smoothing * new
