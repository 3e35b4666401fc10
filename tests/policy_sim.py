"""The speculation policy's simulated world, shared by its tests: batch-dependent step costs, chain rounds of a
given mean accept length, a clock the goodput arbiter reads, and policies seeded as the engine's warm-up seeds them."""

from __future__ import annotations

import random

from tandem.speculative.policy import PolicyConfig, RequestSpecState, SpeculationPolicy

WIDTH = 4  # a chain of 3 drafts


def plain_ms(n: int) -> float:
    """A decode step: weights read once (launch- and bandwidth-bound), a little per request."""
    return 4.0 + 0.03 * n


def spec_ms(n: int) -> float:
    """A round: drafting and extending (fixed, and per request), a verify of 4 rows per request that
    turns compute-bound as the batch grows: ~1.2x a plain step at batch 1, ~2.7x at batch 64."""
    return 4.6 + 0.2 * n + 0.03 * WIDTH * n + 0.0025 * (WIDTH * n) ** 1.5


def round_tokens(rng: random.Random, tau: float) -> int:
    """Tokens of one chain round (accepted drafts + bonus) whose mean is ``tau``: each draft accepted
    with probability a after the one before it (a found by bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a ** k for k in range(WIDTH)) < tau else (lo, a)
    made = 1
    while made < WIDTH and rng.random() < a:
        made += 1
    return made


def step_tokens(policy: SpeculationPolicy, states: list, speculate: bool, rng: random.Random, tau: float) -> int:
    """The tokens one step makes over ``states`` (a round's each, reported to the policy, or one each)."""
    made = 0
    for state in states:
        got = round_tokens(rng, tau) if speculate else 1
        if speculate:
            policy.observe_round(state, got)
        made += got
    return made


class SimClock:
    """Simulated seconds: what the policy's goodput arbiter reads instead of the wall clock."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(policy: SpeculationPolicy, n: int, taus: list[float], steps: int, seed: int,
             unseen_ms: tuple[float, float] = (0.0, 0.0), plain=None, spec=None) -> float:
    """Decode ``steps`` steps of a batch of ``n`` requests (request i's rounds have mean ``taus[i % len]``)
    under ``policy``, step times ±5 % noise, its goodput reported as the engine does (on the policy's
    clock, when it is a SimClock); ``unseen_ms``: (plain, speculative) time each step also costs that the
    cost model's step times do not include (a server's work around the steps) but goodput does; ``plain``,
    ``spec``: step-time functions of n (default plain_ms, spec_ms); → tokens per ms."""
    plain, spec = plain or plain_ms, spec or spec_ms
    rng = random.Random(seed)
    clock = policy.goodput.clock if policy.goodput is not None else None
    states = [RequestSpecState() for _ in range(n)]
    tokens, spent = 0, 0.0
    for _ in range(steps):
        speculate = policy.decide(n, states)
        ms = (spec(n) if speculate else plain(n)) * rng.uniform(0.95, 1.05)
        unseen = unseen_ms[speculate]
        before = tokens
        for i, state in enumerate(states):
            made = round_tokens(rng, taus[i % len(taus)]) if speculate else 1
            if speculate:
                policy.observe_round(state, made)
            tokens += made
        policy.observe_step(n, speculate, 1, ms / 1e3)
        if isinstance(clock, SimClock):
            clock.now += (ms + unseen) / 1e3
        policy.observe_goodput(n, speculate, n if not speculate else tokens - before, (ms + unseen) / 1e3)
        spent += ms + unseen
    return tokens / spent


def seeded(cfg: PolicyConfig = PolicyConfig()) -> SpeculationPolicy:
    """A policy whose cost table was seeded as the engine's warm-up does: both kinds of step timed at
    each batch bucket, then what the warm-up's rounds taught forgotten (on a simulated clock)."""
    policy = SpeculationPolicy(cfg, clock=SimClock())
    for n in (1, 2, 4, 8, 16, 32, 64):
        for _ in range(3):
            policy.observe_step(n, False, 1, plain_ms(n) / 1e3)
            policy.observe_step(n, True, 1, spec_ms(n) / 1e3)
        policy.observe_round(RequestSpecState(), 1)
    policy.forget_traffic()
    return policy


def warmed_with_goodput() -> SpeculationPolicy:
    """A policy after a service's warm-up: costs and goodput of both kinds of step measured at every bucket, then
    what its rounds taught forgotten (on a simulated clock)."""
    policy = SpeculationPolicy(clock=SimClock())
    clock = policy.goodput.clock
    for size in (1, 2, 4, 8, 16, 32, 64):
        for speculative, ms, tokens in ((False, plain_ms(size), size), (True, spec_ms(size), 2 * size)):
            for _ in range(16):
                policy.observe_step(size, speculative, 1, ms / 1e3)
                clock.now += ms / 1e3
                policy.observe_goodput(size, speculative, tokens, ms / 1e3)
        policy.observe_round(RequestSpecState(), 1)
    policy.forget_traffic()
    return policy
