"""The speculation policy decides for the running batch by tokens per second: against simulated, batch-dependent
costs and accept lengths (tests/policy_sim.py) it picks the better of speculating and not, explores the other rarely
and by what it costs, and counts rounds that cannot draft as one token. The engine's side: test_spec_policy_engine.py;
measured goodput and step costs: test_goodput.py."""

from __future__ import annotations

import random

import pytest

from policy_sim import SimClock, plain_ms, seeded, simulate, step_tokens, warmed_with_goodput
from tandem.speculative.policy import PolicyConfig, RequestSpecState, SpeculationPolicy, cost_bucket


@pytest.mark.parametrize("n", [1, 8, 32, 64])
@pytest.mark.parametrize("tau", [1.0, 1.5, 2.0, 3.0, 4.0])
def test_the_policy_is_within_3_percent_of_the_better_of_always_and_never(n, tau):
    """Across batch sizes where speculation pays and where it does not (the break-even τ rises from
    ~1.2 at batch 1 to ~2.7 at batch 64), the policy's tokens per second stay within 3 % of the better
    of speculating always and never, learning, exploring and re-timing included."""
    steps = 600
    for seed in range(2):
        always = simulate(SpeculationPolicy(PolicyConfig(enabled=False)), n, [tau], steps, seed)
        never = n / plain_ms(n)
        chosen = simulate(seeded(), n, [tau], steps, seed)
        assert chosen >= 0.97 * max(always, never), (n, tau, seed, chosen, always, never)


@pytest.mark.parametrize("n", [1, 8, 64])
def test_new_traffic_does_not_measure_plain_steps_again_at_once(n):
    """After the warm-up (or any traffic) measured plain steps' goodput, new traffic forgets what speculation made,
    not what a plain step costs: a short run at τ 4 (~50 steps, a third of a second) speculates throughout, within
    3 % of always, instead of spending an early epoch re-measuring plain steps."""
    policy = warmed_with_goodput()
    always = simulate(SpeculationPolicy(PolicyConfig(enabled=False)), n, [4.0], 48, seed=0)
    chosen = simulate(policy, n, [4.0], 48, seed=0)
    assert chosen >= 0.97 * always, (chosen, always)


def test_a_head_that_accepts_nothing_is_not_explored_at_once():
    """A useless head (every round one token) at batch 64 on a warm engine, a run of ~1 s (a bench cell): its rounds
    cannot beat a plain step, which makes the same token for less, so after the warm-up's round the rejected mode's
    first epoch is not hastened — an exploration within 0.1 s would cost several rounds, each dearer than a plain
    step, in a run this short. One speculative step (the warm-up's) in the whole run."""
    n = 64
    policy = warmed_with_goodput()
    chosen = simulate(policy, n, [1.0], int(1000 / plain_ms(n)), seed=0)
    assert policy.rounds_all == n  # (a round a request: one speculative step)
    assert chosen >= 0.96 * n / plain_ms(n)  # (that step is a round of ~11 plain steps' cost here)


def test_rounds_of_one_token_settle_plain_only_by_the_requests_that_draft():
    """Plain is settled without a goodput verdict where the drafting requests' rounds make one token each, not where
    rows that cannot draft (prompts not yet on the drafter, a batch ramping up) dilute the batch's τ towards one:
    one request drafting at τ 2 among 64 (the batch's τ 1.016) says nothing against the head."""
    def settled(drafting_tau: float, drafting: int) -> bool:
        policy = SpeculationPolicy(clock=SimClock())
        for _ in range(3):
            policy.observe_step(64, False, 1, 0.0056)
            policy.observe_step(64, True, 1, 0.0095)
        states = [RequestSpecState() for _ in range(drafting)]
        for _ in range(8):
            for state in states:
                policy.observe_round(state, drafting_tau)
        return not policy.decide(64, states) and policy.plain_measured_faster(64)

    assert settled(1.0, 64) and settled(1.0, 1)
    assert not settled(2.0, 1) and not settled(2.0, 64)


def test_rounds_of_one_token_settle_plain_only_on_rounds_of_the_requests_running():
    """After rounds of one token (the engine's mean τ 1), requests with no round of their own yet (new traffic, a batch
    after a detached period) are not settled plain by that mean: the text may have changed, and a settled batch never
    drafts, so nothing would ever tell. Once they have rounds of one token too, they are."""
    policy = SpeculationPolicy(clock=SimClock())
    for _ in range(3):
        policy.observe_step(8, False, 1, 0.005)
        policy.observe_step(8, True, 1, 0.006)
    for _ in range(16):
        policy.observe_round(RequestSpecState(), 1)  # earlier requests: one token a round
    fresh = [RequestSpecState() for _ in range(8)]
    assert not policy.decide(8, fresh) and not policy.plain_measured_faster(8)
    for state in fresh:
        policy.observe_round(state, 1)
    assert not policy.decide(8, fresh) and policy.plain_measured_faster(8)


@pytest.mark.parametrize("seed", [0, 1])
def test_measured_goodput_corrects_a_model_that_misses_the_time_around_the_steps(seed):
    """A server's per-step work (streaming, scheduling) that the cost model's step times leave out makes
    rounds cheaper than the model thinks: it turns speculation off at τ 3 (ratio 3.5 seen), yet each round
    makes 3 tokens for 1.5 plain steps' real time. The goodput arbiter measures both and speculates; and in
    the opposite case (rounds dearer than seen: an arrival's drafter extension) it stops speculating."""
    def plain_fast(n):
        return 1.0

    def spec_seen(n):
        return 3.5

    steps, unseen = 3000, (4.0, 4.0)
    always = simulate(SpeculationPolicy(PolicyConfig(enabled=False)), 8, [3.0], steps, seed, unseen, plain_fast, spec_seen)
    model_only = simulate(SpeculationPolicy(PolicyConfig(goodput=False)), 8, [3.0], steps, seed, unseen, plain_fast, spec_seen)
    chosen = simulate(SpeculationPolicy(clock=SimClock()), 8, [3.0], steps, seed, unseen, plain_fast, spec_seen)
    assert model_only < 0.75 * always  # the model alone is misled ...
    assert chosen >= 0.9 * always, (chosen, always, model_only)  # ... goodput is not

    def plain_seen(n):
        return 4.0

    def spec_cheap(n):
        return 5.0

    dear = (0.0, 4.0)  # rounds: 9 ms for 1.5 tokens; plain 4 ms for 1
    never = 8 / plain_seen(8)
    model_only = simulate(SpeculationPolicy(PolicyConfig(goodput=False)), 8, [1.5], steps, seed, dear, plain_seen, spec_cheap)
    chosen = simulate(SpeculationPolicy(clock=SimClock()), 8, [1.5], steps, seed, dear, plain_seen, spec_cheap)
    assert model_only < 0.8 * never
    assert chosen >= 0.93 * never, (chosen, never, model_only)


def test_the_cost_ratio_is_kept_per_batch_bucket():
    policy = SpeculationPolicy()
    assert policy.cost_ratio(8) == PolicyConfig().default_cost_ratio  # nothing measured
    policy.observe_step(1, False, 1, 0.010)
    policy.observe_step(1, True, 1, 0.012)
    policy.observe_step(64, False, 4, 4 * 0.020)  # a run of 4 decode steps: 20 ms each
    policy.observe_step(64, True, 1, 0.060)
    assert policy.cost_ratio(1) == pytest.approx(1.2)
    assert policy.cost_ratio(50) == pytest.approx(3.0)  # 50 rounds to the bucket of 64
    assert policy.cost_ratio(3) == pytest.approx(1.2)  # unmeasured: the nearest measured bucket's
    assert policy.cost_ratio(20) == pytest.approx(3.0)
    assert [cost_bucket(n) for n in (1, 2, 3, 5, 6, 12, 48, 100)] == [1, 2, 4, 4, 8, 16, 64, 128]
    # runs of 4 rounds and lone rounds mixed: their time over their rounds, the slowest sample left out
    mixed = SpeculationPolicy()
    for seconds, steps in ((0.008, 4), (0.003, 1), (0.008, 4), (0.0025, 1)):
        mixed.observe_step(8, True, steps, seconds)
    assert mixed.step_time(8, True) == pytest.approx((0.008 + 0.008 + 0.0025) / 9)


def test_explorations_are_spaced_by_what_resuming_costs():
    """An exploration that finds nothing costs its step's time beyond a plain step's (the drafter's
    catch-up included): spaced so that this is at most explore_budget (1 %) of the plain steps between."""
    policy = SpeculationPolicy(PolicyConfig(fixed_cost_ratio=1.5, warmup_rounds=0))
    state = RequestSpecState()
    policy.observe_round(state, 1)
    policy.observe_step(1, False, 4, 0.040)  # 10 ms a plain step
    assert policy._explore_gap(1, 1.5) == 36  # nothing known of resuming: 16 x 1.5²
    policy.observe_step(1, True, 1, 0.050, resumed=True)  # resuming took 40 ms more than a plain step
    assert policy._explore_gap(1, 1.5) == 400  # 40 ms is 1 % of 400 plain steps
    policy.observe_step(1, True, 1, 100.0, resumed=True)
    policy.observe_step(1, True, 1, 100.0, resumed=True)
    assert policy._explore_gap(1, 1.5) == PolicyConfig().explore_max_gap


@pytest.mark.parametrize("seed", [0, 1])
def test_at_break_even_explorations_are_spaced_by_the_switch_they_pay(seed):
    """Batch 64 where speculating and plain steps make the same tokens per second (τ 1.75: a 10 ms round against
    a 5.7 ms plain step), and every switch back to speculation first catches the drafter up over the batch's held
    steps (16 ms more: the 8B shape's resume at batch 64), a price goodput leaves out (it is the switch's, not a
    mode's). Modes this close lose little per step, so their explorations would come every 0.1 s and pay that
    catch-up each time: they must be spaced by what the switch costs, keeping the policy within 3 % of either."""
    plain_s, round_s, catch_up_s, tau, n = 0.0057, 0.010, 0.016, 1.75, 64
    rng = random.Random(seed)
    clock = SimClock()
    policy = SpeculationPolicy(clock=clock)
    for _ in range(3):  # the warm-up's seeds
        policy.observe_step(n, False, 1, plain_s)
        policy.observe_step(n, True, 1, round_s)
    states = [RequestSpecState() for _ in range(n)]
    tokens, was_speculating, switches = 0, True, 0
    while clock.now < 20.0:
        speculate = policy.decide(n, states)
        resumed = speculate and not was_speculating
        seconds = (round_s + (catch_up_s if resumed else 0.0) if speculate else plain_s) * rng.uniform(0.97, 1.03)
        made = step_tokens(policy, states, speculate, rng, tau)
        policy.observe_step(n, speculate, 1, seconds, resumed=resumed)
        clock.now += seconds
        if not resumed:  # (the engine's goodput leaves a catch-up's round out)
            policy.observe_goodput(n, speculate, made, seconds)
        tokens, switches, was_speculating = tokens + made, switches + resumed, speculate
    rate = tokens / clock.now
    better = max(n / plain_s, n * tau / round_s)
    assert rate >= 0.97 * better, (rate, better, switches)


def test_requests_that_cannot_draft_count_one_token_a_round():
    """A batch of 4 where 2 requests draft at τ 3: the batch makes (3 + 3 + 1 + 1) / 4 = 2 tokens per
    request-round; it speculates where the ratio is below that and not where it is above."""
    states = [RequestSpecState() for _ in range(2)]
    cheap = SpeculationPolicy(PolicyConfig(fixed_cost_ratio=1.8, warmup_rounds=0, confidence_z=0.0))
    dear = SpeculationPolicy(PolicyConfig(fixed_cost_ratio=2.2, warmup_rounds=0, confidence_z=0.0))
    for policy in (cheap, dear):
        for _ in range(40):
            for state in states:
                policy.observe_round(state, 3)
    assert cheap.decide(4, states) and not dear.decide(4, states)


def test_off_explores_rarer_the_more_a_round_costs():
    """Off, one speculative step every explore_every x ratio² plain steps measures the batch again; on,
    a plain step times t_plain, then re-times it every plain_probe_every speculative steps."""
    for ratio, period in ((1.5, 36), (3.0, 144)):
        policy = SpeculationPolicy(PolicyConfig(fixed_cost_ratio=ratio, warmup_rounds=0))
        state = RequestSpecState()
        policy.observe_round(state, 1)
        decisions = []
        for _ in range(2 * period + 2):
            speculate = policy.decide(1, [state])
            decisions.append(speculate)
            if speculate:
                policy.observe_round(state, 1)
            policy.observe_step(1, speculate)
        assert [i for i, d in enumerate(decisions) if d] == [period, 2 * period + 1], ratio
    policy = SpeculationPolicy(PolicyConfig(plain_probe_every=8, warmup_rounds=0))
    state = RequestSpecState()
    decisions = []
    for _ in range(20):
        speculate = policy.decide(1, [state])
        decisions.append(speculate)
        if speculate:
            policy.observe_round(state, 4)
        policy.observe_step(1, speculate, 1, 0.010 if speculate else 0.009)
    # the first after plain_probe_first (4) speculative steps, t_plain being unknown; then every 8
    assert [i for i, d in enumerate(decisions) if not d] == [4, 13]


def test_step_time_is_total_time_over_total_steps_without_the_slowest_sample_once_there_are_three():
    policy = SpeculationPolicy(PolicyConfig())
    policy.observe_step(4, False, steps=1, seconds=0.010)
    policy.observe_step(4, False, steps=4, seconds=0.012)  # a run: 3 ms a step
    assert policy.step_time(4, False) == pytest.approx(0.022 / 5)  # two samples: none left out
    policy.observe_step(4, False, steps=2, seconds=0.005)
    # three: the 10-ms single step (the slowest a step) is left out, whichever class it is of
    assert policy.step_time(4, False) == pytest.approx((0.012 + 0.005) / 6)
    assert policy.step_time(4, False, runs=True) == pytest.approx(0.017 / 6)  # two runs: none left out
    assert policy.step_time(4, False, runs=False) == pytest.approx(0.010)
    policy.observe_step(4, False, steps=1, seconds=0.010)  # as slow as the first: the latest of the two goes
    assert policy.step_time(4, False) == pytest.approx((0.010 + 0.012 + 0.005) / 7)
    assert policy.step_time(4, True) is None and policy.step_time(64, False) is None
