"""SpeculationPolicy: speculate this step or not, for the whole batch, by the tokens per second of each.

A step over n decoding requests costs ``t_plain(n)`` as a plain decode step and ``t_spec(n)`` as a
speculative round (drafting, a W-wide verify, the drafter's extension). A plain step yields n tokens,
a round yields the sum of the requests' tokens per round (accepted drafts + the bonus, τ). So the batch
speculates when its mean τ is at least ``t_spec(n) / t_plain(n)``, the cost ratio at that batch size.

The decision is the batch's, not each request's: a verify forward runs every row of its width for every
request in it, so a request left plain inside a speculating batch saves nothing, while a batch mixing
widths would leave the captured graphs. Per-request τ still counts (each request's recent rounds,
decayed per token and shrunk towards the engine's mean, so that two rounds do not speak for a text).

Costs depend on the batch: at batch 1 a verify of 4 tokens costs about a decode step, at batch 64 it is
compute-bound. They are kept per batch bucket (powers of two; tandem.speculative.step_costs) from the recent steps
there (their time over their steps, the slowest left out), seeded by the engine's warm-up (``tandem.engine.warmup``), which
runs both kinds of step at several batch sizes before a service reports SERVING. A bucket measured only one
way takes the ratio of the nearest bucket measured both ways.

Learning: while the batch speculates, every ``plain_probe_every`` speculative steps one plain step keeps
t_plain current. While it does not, no round refreshes τ, so now and then one speculative step (an
exploration) measures every running request: rarer the more a round costs (the higher the ratio, the less
likely the text has become easy enough), and rarer the more resuming costs — the drafter first takes in
what the plain steps held, so an exploration costs its measured step time beyond a plain step's, and
explorations are spaced so that this stays a small share (``explore_budget``) of the time between them.

Arrivals: a prompt admitted while speculating is extended into the drafter at once, which plain decoding
skips (it holds the prompt's features for a later draft). Per output token that costs the extension's
measured seconds per prompt token times the traffic's prompt tokens per output token; on a small target
whose steps take a fraction of a millisecond it can outweigh what the rounds gain, so it is charged
against the plain step in the cost ratio.

Measured goodput has the last word: the engine reports every step's tokens and wall time, and where both
modes have been measured at a batch size the faster one runs (tandem.speculative.goodput); the model above
chooses where nothing is measured yet.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from tandem.speculative.chain_depth import ChainDepth, chain_ladder
from tandem.speculative.goodput import GoodputArbiter
from tandem.speculative.round_times import RoundTimes
from tandem.speculative.step_costs import DecayedMean, StepCosts, cost_bucket


# plain_reason of plain steps taken only to measure plain while the policy keeps speculating (an exploration of plain
# steps, a step timing one): passing, they do not settle anything (DrafterAttachment.after_decision's ``passing``)
PASSING_PLAIN = frozenset({"exploring", "timing"})


@dataclass(frozen=True)
class PolicyConfig:
    enabled: bool = True  # False: speculate at every step (--speculation-policy always)
    warmup_rounds: int = 8  # rounds (all requests') before τ is trusted to turn speculation off
    request_window_tokens: int = 128  # a request's τ: over about its latest this many tokens
    prior_rounds: float = 2.0  # the engine's mean τ counts as this many rounds of a request's own
    confidence_z: float = 1.0  # off only when mean τ + z standard errors is below the cost ratio
    engine_window: int = 256  # rounds: the engine's mean τ (all requests) decays over about this many
    default_cost_ratio: float = 1.3  # t_spec / t_plain where nothing is measured yet
    fixed_cost_ratio: float | None = None  # use this ratio at every batch size instead of measuring (tests)
    plain_probe_every: int = 256  # speculative steps between two plain steps that re-time t_plain
    plain_probe_first: int = 4  # ... and before the first, at a batch size whose t_plain is unknown
    explore_every: int = 16  # plain steps between two explorations, times the cost ratio squared, at least
    explore_budget: float = 0.01  # ... and enough that resuming (a catch-up and a round) costs at most this share
    explore_max_gap: int = 1024  # plain steps: the longest an exploration waits
    step_samples: int = 16  # timed steps kept per bucket and kind (see SpeculationPolicy.step_time)
    arrival_window: int = 64  # arrivals / finished requests: the prompt-extension cost decays over about this many
    # Measured goodput overrides the model (tandem.speculative.goodput; off with a fixed ratio or enabled=False)
    goodput: bool = True
    settled_margin: float = 0.25  # without a goodput verdict, plain is settled once τ is this far below the cost ratio
    goodput_epoch_steps: int = 8  # an epoch of one mode: at least this many steps ...
    goodput_epoch_s: float = 0.05  # ... and seconds (served: a pause does not end one)
    goodput_window_s: float = 0.5  # a mode's goodput at a bucket decays over about this many seconds of it
    goodput_min_s: float = 0.05  # measured: at least this many (decayed) seconds ...
    goodput_stale_s: float = 30.0  # ... the latest less than this long ago, in served time (idle left out)
    goodput_detached_stale_s: float = 5.0  # plain measured detached speaks for plain this long after its last step (clock)
    goodput_margin: float = 0.03  # the other mode must be this much faster to take over
    goodput_tie_s: float = 0.3  # after a detached period, speculation is called slower only once measured this long
    goodput_explore_steps: int = 2  # an exploration of the other mode: at least this many steps (and goodput_epoch_s)
    goodput_explore_cost: float = 0.01  # measuring the slower mode again costs about this share of goodput ...
    goodput_explore_max_s: float = 5.0  # ... measured again at least this often
    goodput_close: float = 0.1  # plain behind speculation by more: measured again only every goodput_explore_max_s
    goodput_first_explore_s: float = 0.1  # the mode the model rejects: its first epoch at a bucket at most this late
    goodput_probe_margin: float = 0.15  # speculation ahead of attached plain steps by less: measure plain detached ...
    # ... or by less than attached plain's measured tax, up to this: where a plain step is host-bound the tax can be
    # large (the demo pair's ~2x, measured while only detached runs were one graph each: tandem.engine.run_graphs)
    goodput_probe_margin_max: float = 2.0
    # a speculating batch drafts the chain (or shorter one) that promises the most tokens a second at its batch size
    # (tandem.speculative.chain_depth; chains only, and only with the measured policy)
    shorter_chains: bool = True


@dataclass
class RequestSpecState:
    """The policy's record of one request's rounds."""

    rounds: int = 0
    recent: "DecayedMean | None" = None  # its rounds' token counts, decayed per token it decodes


@functools.lru_cache(maxsize=16)
def _ladder(spec) -> tuple:
    return chain_ladder(spec)  # (cached: asked at every speculative step, and the same tuple each time)


class SpeculationPolicy(StepCosts):
    def __init__(self, cfg: PolicyConfig = PolicyConfig(), clock=None):
        super().__init__(cfg)
        measured = cfg.goodput and cfg.enabled and cfg.fixed_cost_ratio is None
        self.goodput = (GoodputArbiter(cfg, cost_bucket, *([clock] if clock else []), switch_cost=self._switch_cost)
                        if measured else None)
        self._all = DecayedMean(cfg.engine_window)  # τ over every request's rounds
        self.rounds_all = 0
        # this step's (batch size, the batch's τ's upper bound, ratio, the drafting requests' own τ's upper bound)
        self._model_view: tuple[int, float, float, float] | None = None
        self.plain_reason: str | None = None  # why this step's decision was plain (None: it speculates), in a word
        self._model_reason = "model"

    # -- the chain's depth ---------------------------------------------------------------------------
    def ladder(self, spec) -> tuple:
        """The SpecConfigs a speculating batch may draft with ``spec`` configured: shorter chains too where this
        policy picks them (the engine captures graphs for each)."""
        return _ladder(spec) if self.cfg.enabled and self.cfg.shorter_chains else (spec,)

    def chain_spec(self, batch_size: int, spec):
        """The SpecConfig this speculative step drafts with ``spec`` configured, at ``batch_size``: ``spec``, or a
        shorter chain that promises more tokens a second there (tandem.speculative.chain_depth)."""
        ladder = self.ladder(spec)
        if len(ladder) > 1:
            if self.depth is None or self.depth.ladder is not ladder:
                self.depth = ChainDepth(ladder)
            # (the step costs' bucket, where its round times are filed: ChainDepth keeps a batch crossing buckets on
            # one depth itself; goodput's held bucket here read one bucket's times while the rounds went to another)
            bucket = cost_bucket(batch_size)
            spec = self.depth.choose(bucket, self._round_times(bucket, ladder))
        return spec

    def _round_times(self, bucket: int, ladder: tuple) -> RoundTimes:
        return RoundTimes(self, bucket, ladder, self.depth.trial_spacing(bucket))

    # -- the decision ----------------------------------------------------------------------------
    def observe_goodput(self, batch_size: int, speculative: bool, tokens: int, seconds: float,
                        detached: bool = False) -> None:
        """Any step run with ``batch_size`` requests running (prefill steps too): the tokens it emitted and
        its wall time up to the next step (tandem.speculative.goodput); ``detached``: the drafter was."""
        if self.goodput is not None:
            self.goodput.observe(batch_size, speculative, tokens, seconds, detached)

    def observe_goodput_steps(self, batch_size: int, speculative: bool, steps, detached: bool = False) -> None:
        """``observe_goodput`` for steps of one kind in a row at one batch size: ``steps`` their ``(tokens,
        seconds)``, oldest first."""
        if self.goodput is not None:
            self.goodput.observe_steps(batch_size, speculative, steps, detached)

    def plain_measured_faster(self, batch_size: int) -> bool:
        """Whether measurements say plain steps are faster at ``batch_size``. With goodput on, its verdict
        (both modes measured), or where it has none the drafting requests' rounds making about one token each (their
        τ's bound within ``goodput_margin`` of 1, as this step's ``decide`` weighed it: a round then makes a plain
        step's tokens for more), never step costs alone: served, a step's time holds the server's share — streaming,
        the GIL — unevenly between runs of rounds and plain steps (the demo pair over REST: rounds timed at 3.3 plain
        steps where they took 1.5). Without it, the batch's τ well below the cost ratio of measured step times (by
        ``settled_margin``: not a guess, nor a close call an exploration should settle), as this step's
        ``decide`` weighed them (asked after it; nothing is computed again)."""
        view, c = self._model_view, self.cfg
        if self.goodput is not None:  # (or rounds that make about one token each: none can beat a plain step)
            verdict = self.goodput.verdict(batch_size)
            return verdict is False or (verdict is None and self._rounds_of_one_token(batch_size))
        if view is None or view[0] != batch_size or c.fixed_cost_ratio is not None:
            return False  # (a fixed ratio is no measurement; a probe or the warm-up weighed nothing)
        if self.step_time(batch_size, True) is None or self.step_time(batch_size, False) is None:
            return False  # this bucket's costs are not measured both ways
        _, tau_upper, ratio, _ = view
        return tau_upper * (1 + c.settled_margin) < ratio

    def probe_detached(self, batch_size: int, ships_features: bool = True) -> bool:
        """Whether to detach briefly now at ``batch_size`` to measure plain steps without the drafter (goodput's
        ``take_probe``, which counts it as taken; never without goodput); ``ships_features``: attached plain steps send
        the drafter every token's features (a drafter service), else they only hold them."""
        return self.goodput is not None and self.goodput.take_probe(batch_size, ships_features,
                                                                     self.attached_plain_tax(batch_size))

    def measured_loss(self, batch_size: int) -> float:
        """The share of goodput the slower mode loses at ``batch_size``, as measured goodput has it (0 without it)."""
        return self.goodput.loss(batch_size) if self.goodput is not None else 0.0

    def measured_lead(self, batch_size: int) -> float | None:
        """Speculation's measured goodput over plain's at ``batch_size``, less one; None unless both are measured."""
        spec, plain = self.goodput.rates(batch_size) if self.goodput is not None else (None, None)
        return None if spec is None or not plain else spec / plain - 1

    def speculation_favoured(self, batch_size: int) -> bool:
        """Whether the last verdict measured at ``batch_size``'s bucket was speculation (kept through a detached
        period, which forgets speculation's goodput but not what it decided) — or, at a bucket with no verdict, the
        traffic's τ clears the cost ratio there by ``settled_margin``: a detach decided at another bucket does not hold
        here (a closed loop's batch swings between a full bucket, where plain measured faster, and the low stretches
        as waves of requests end, where speculation pays most: detached for the one, the other ran plain too)."""
        if self.goodput is None:
            return False
        if self.goodput.has_verdict(batch_size):
            return self.goodput.favours_speculation(batch_size)
        tau = self._all.mean
        return tau is not None and tau >= self.cost_ratio(batch_size) * (1 + self.cfg.settled_margin)

    def explain(self, batch_size: int) -> str:
        """What this step's decision at ``batch_size`` weighed, in words for a log line."""
        parts = []
        if self.goodput is not None:
            spec, plain = self.goodput.rates(batch_size)
            parts.append("measured goodput: " + ", ".join(f"{name} {'-' if r is None else f'{r:.0f}'} tok/s"
                                                         for name, r in (("speculating", spec), ("plain", plain))))
            tokenless = self.goodput.tokenless_share(batch_size)
            if tokenless:
                parts[-1] += f" (speculation's seconds {100 * tokenless:.0f} % extending prompts)"
        if self._model_view is not None and self._model_view[0] == batch_size:
            parts.append(f"τ at most {self._model_view[1]:.2f} against a cost ratio of {self._model_view[2]:.2f}")
        times = [self.step_time(batch_size, mode) for mode in (False, True)]
        parts.append("step costs " + " / ".join("-" if t is None else f"{1e3 * t:.2f}" for t in times) + " ms plain / round"
                     f", prompt extension {1e6 * self.arrival_cost_per_output_token():.1f} µs per output token")
        return "; ".join(parts)

    def decide(self, batch_size: int, drafting: list[RequestSpecState], runs: bool | None = None) -> bool:
        """Whether this step speculates: ``drafting`` are the states of the requests that can draft, out of
        ``batch_size`` decoding requests (the others ride along as plain rows of the same forward);
        ``runs``: whether this step can be a run of several steps (None: unknown). The cost model's answer,
        unless measured goodput says otherwise (tandem.speculative.goodput)."""
        self._model_view, self.plain_reason = None, None
        if not drafting:
            self.plain_reason = "no drafts"
            return False
        if not self.cfg.enabled:
            return True
        model_says = self.model_decision(batch_size, drafting, runs)
        if self.goodput is None or self._learning:
            self.plain_reason = None if model_says else self._model_reason
            return model_says  # (in the warm-up rounds it speculates to learn the traffic's τ)
        rounds_can_pay = not self._rounds_of_one_token(batch_size)
        mode = self.goodput.choose(batch_size, model_says, lambda: self._predicted_loss(batch_size, drafting, runs),
                                   rounds_can_pay)
        basis = self.goodput.basis
        self.plain_reason = None if mode else self._model_reason if basis == "model" else basis
        return mode

    def _rounds_of_one_token(self, batch_size: int) -> bool:
        """Whether this step's ``decide`` found the drafting requests' rounds making about one token each (their τ's
        upper bound within ``goodput_margin`` of 1): a round then makes a plain step's tokens for more."""
        view = self._model_view
        return view is not None and view[0] == batch_size and view[3] <= 1 + self.cfg.goodput_margin

    def _predicted_loss(self, batch_size: int, drafting: list[RequestSpecState], runs: bool | None) -> float:
        """The share of goodput the model expects the mode it rejects to lose: 1 - min(τ/ratio, ratio/τ)
        (a round makes τ tokens in ratio plain steps' time)."""
        tau, ratio = self._batch_tau(batch_size, drafting)[0], self.cost_ratio(batch_size, runs)
        return 1 - min(tau / ratio, ratio / tau)

    def model_decision(self, batch_size: int, drafting: list[RequestSpecState], runs: bool | None = None) -> bool:
        """The cost model's answer: the batch's τ against the cost ratio, with probes and explorations."""
        c = self.cfg
        if self._learning:
            return True  # too little known about this traffic: find out
        ratio = self.cost_ratio(batch_size, runs)
        if c.fixed_cost_ratio is None:  # time a plain step where none is known, and now and then again
            every = c.plain_probe_every if self.step_time(batch_size, False) is not None else c.plain_probe_first
            if self.spec_steps_since_plain >= every:
                self._model_reason = "timing"
                return False
        self._model_reason = "model"
        mean, stderr, own = self._batch_tau(batch_size, drafting)
        # (for plain_measured_faster; the drafting requests' own: rows that cannot draft say nothing of the head — and
        # only once each has rounds of its own: the engine's mean alone, kept from earlier traffic while no round ran,
        # would settle every later batch plain without one round of it ever being tried)
        n = len(drafting)
        drafting_mean = (mean * batch_size - (batch_size - n)) / n
        drafting_upper = drafting_mean + c.confidence_z * stderr * batch_size / n if own else math.inf
        self._model_view = (batch_size, mean + c.confidence_z * stderr, ratio, drafting_upper)
        if mean + c.confidence_z * stderr >= ratio:
            return True
        return self.plain_steps_since_spec >= self._explore_gap(batch_size, ratio)

    def _explore_gap(self, batch_size: int, ratio: float) -> int:
        """Plain steps between two explorations: explore_every x ratio², and enough that an exploration
        that does not pay (its step's time beyond a plain step's, the catch-up included) costs at most
        explore_budget of the plain steps between two."""
        c = self.cfg
        gap = math.ceil(c.explore_every * max(1.0, ratio) ** 2)
        plain = self.step_time(batch_size, False)
        if plain:
            gap = max(gap, math.ceil(self._switch_cost(cost_bucket(batch_size)) / (c.explore_budget * plain)))
        return min(gap, c.explore_max_gap)

    def _batch_tau(self, batch_size: int, drafting: list[RequestSpecState]) -> tuple[float, float, bool]:
        """Expected tokens per request per round over the batch, its standard error (requests that cannot draft
        make one token), and whether every drafting request has rounds of its own."""
        k, prior, prior_var = self.cfg.prior_rounds, self._all.mean, self._all.variance
        total, weight, own = float(batch_size - len(drafting)), 0.0, True
        for state in drafting:
            recent = state.recent
            w = recent.weight if recent is not None else 0.0
            total += (w * recent.mean + k * prior) / (w + k) if w else prior
            weight, own = weight + w, own and w > 0
        # Rounds of one request scatter around its τ; the batch's mean is known to within the engine's
        # spread over the rounds it rests on (the prior counting as k rounds per request).
        samples = weight + k * len(drafting)
        return total / batch_size, math.sqrt(prior_var / samples) * len(drafting) / batch_size, own

    # -- acceptance ------------------------------------------------------------------------------
    def observe_round(self, state: RequestSpecState, tokens: int, depth: int | None = None) -> None:
        """A speculative round of the request emitted ``tokens`` (accepted drafts + bonus); ``depth``: the drafts of
        its chain (None: a tree)."""
        if depth is not None and self.depth is not None:
            self.depth.observe(depth, tokens - 1)
        state.rounds += 1
        if state.recent is None:
            state.recent = DecayedMean(self.cfg.request_window_tokens)
        state.recent.decay(tokens)  # decayed per token: a round of 5 ages the past as 5 plain steps do
        state.recent.add(tokens)
        self._all.decay(1)
        self._all.add(tokens)
        self.rounds_all += 1

    def learning_rounds_left(self) -> int:
        """Rounds (all requests') this policy still speculates to learn the traffic's τ since start-up or new traffic
        (``warmup_rounds`` in all); 0 once learnt, and always 0 when it speculates always."""
        return self._rounds_to_learn if self.cfg.enabled else 0

    @property
    def _rounds_to_learn(self) -> int:
        """Rounds still to be heard of start-up's or new traffic before τ is trusted (``warmup_rounds`` in all)."""
        return max(0, max(1, self.cfg.warmup_rounds) - self.rounds_all)

    @property
    def _learning(self) -> bool:
        """Fewer than ``warmup_rounds`` rounds heard since start-up or new traffic: τ is not trusted yet."""
        return self._rounds_to_learn > 0

    @property
    def tau_all(self) -> float | None:
        """The engine's mean tokens per round over its recent rounds (every request's)."""
        return self._all.mean

    def forget_traffic(self) -> None:
        """Drop what rounds taught (the warm-up's random prompts say nothing of real traffic); keep costs."""
        self._all, self.rounds_all = DecayedMean(self.cfg.engine_window), 0
        self._prompt_per_output = DecayedMean(self.cfg.arrival_window)  # (the extension's speed is kept)
        self.spec_steps_since_plain = self.plain_steps_since_spec = 0
        self.depth = None  # (acceptance by position is the traffic's too; the costs it weighs are kept)
        if self.goodput is not None:
            self.goodput.forget_traffic()
