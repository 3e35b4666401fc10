"""Measured goodput and step costs (tandem.speculative.goodput, step_costs): costs compared within runs or single
steps, prompt extension charged to speculation, detached plain steps as plain's goodput, explorations and probes spaced
by served time and what they cost, one probe in goodput_stale_s whatever the bucket, a batch about a bucket's edge
measured as one load, and plain decisions that say why."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from policy_sim import SimClock, simulate, step_tokens, warmed_with_goodput
from tandem.speculative.policy import PolicyConfig, RequestSpecState, SpeculationPolicy


def test_costs_are_compared_within_runs_or_within_single_steps():
    """Arrivals cut runs short. Lone rounds (8 ms) against lone plain steps (5 ms) give a ratio of 1.6, a
    win at τ 3; pooled with plain runs (4 steps in 5 ms) the plain step looks cheaper than it is under
    arrivals, and the ratio (4) would turn speculation off. Within runs, the runs' own costs count."""
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=0, confidence_z=0.0))
    for _ in range(5):
        policy.observe_step(64, True, 1, 0.008)
        policy.observe_step(64, False, 1, 0.005)
        policy.observe_step(64, False, 4, 0.005)
    assert policy.cost_ratio(64, runs=False) == pytest.approx(1.6)
    # pooled, the slowest sample (a lone plain step) left out: 4 lone steps and 5 runs, 45 ms over 24 steps
    assert policy.cost_ratio(64) == pytest.approx(0.008 / (0.045 / 24))
    for _ in range(5):
        policy.observe_step(64, True, 4, 0.016)
    assert policy.cost_ratio(64, runs=True) == pytest.approx(0.004 / 0.00125)
    states = [RequestSpecState() for _ in range(64)]
    for _ in range(4):
        for state in states:
            policy.observe_round(state, 3)
    policy.spec_steps_since_plain = 0
    assert policy.decide(64, states, runs=False) and not policy.decide(64, states, runs=True)


def test_an_arrivals_drafter_extension_is_charged_against_the_plain_step():
    """A round costs 1.5 plain steps (1 ms): at τ 3 the batch of 8 speculates. When each arriving prompt
    (100 tokens, for outputs of 100) costs the drafter 0.1 ms per token to take in — 10 ms a request, 0.1 ms
    per output token, 0.8 ms per plain step of 8 — the ratio becomes 1.5 / (1 - 0.8) = 7.5 and it does not."""
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=0, confidence_z=0.0))
    for _ in range(5):
        policy.observe_step(8, True, 1, 0.0015)
        policy.observe_step(8, False, 1, 0.001)
    states = [RequestSpecState() for _ in range(8)]
    for _ in range(4):
        for state in states:
            policy.observe_round(state, 3)
    policy.spec_steps_since_plain = 0
    assert policy.cost_ratio(8) == pytest.approx(1.5) and policy.decide(8, states)
    policy.observe_finished(100, 100)
    assert policy.cost_ratio(8) == pytest.approx(1.5)  # no extension measured yet: nothing charged
    policy.observe_arrivals(200, 0.020)  # two prompts of 100 tokens in 20 ms
    assert policy.arrival_cost_per_output_token() == pytest.approx(1e-4)
    assert policy.cost_ratio(8) == pytest.approx(7.5) and not policy.decide(8, states)
    assert policy.cost_ratio(1) == pytest.approx(0.0015 / 0.0009)  # one request pays its own arrivals only


def test_the_arrival_charge_is_total_extension_seconds_over_total_output_tokens():
    """Prompts of different lengths whose extension costs the same 1 ms each (a launch-bound drafter): a mean of
    per-token costs (1 ms / 10 tokens beside 1 ms / 190) made the charge 10x the traffic's; its sums make it exact:
    2 ms for 200 prompt tokens, 200 prompt tokens for 400 output tokens → 5 µs per output token."""
    policy = SpeculationPolicy(PolicyConfig())
    policy.observe_arrivals(10, 0.001)
    policy.observe_arrivals(190, 0.001)
    policy.observe_finished(10, 300)
    policy.observe_finished(190, 100)
    assert policy.arrival_cost_per_output_token() == pytest.approx(0.002 / 400, rel=0.02)


def test_plain_steps_with_the_drafter_detached_are_plain_goodput_once_measured():
    """Attached plain steps pay for the drafter's input; detached ones are what plain decoding costs once the
    policy has settled on it. Measured detached, they are plain's goodput, and the verdict follows them; a detached
    period forgets speculation's goodput (it could not be measured meanwhile)."""
    from tandem.speculative.goodput import GoodputArbiter
    from tandem.speculative.policy import cost_bucket

    clock, cfg = SimClock(), PolicyConfig()
    arbiter = GoodputArbiter(cfg, cost_bucket, clock)

    def meter(speculative, tokens_per_s, seconds=0.3, detached=False):
        for _ in range(30):
            clock.now += seconds / 30
            arbiter.observe(8, speculative, tokens_per_s * seconds / 30, seconds / 30, detached)

    def verdict():
        """Epoch ends until one that is not an exploration: the mode measured faster."""
        for _ in range(200):
            clock.now += cfg.goodput_epoch_s
            arbiter._epoch_steps = cfg.goodput_epoch_steps  # (the epoch's steps, as observe would count them)
            arbiter.choose(8, True, lambda: 0.1)
            if arbiter.verdict(8) is not None:
                return arbiter.verdict(8)
        raise AssertionError("no verdict")

    assert arbiter.verdict(8) is None  # nothing measured
    meter(True, 1000.0)
    meter(False, 900.0)  # attached plain: slower than speculating
    assert verdict() is True
    meter(False, 1200.0, detached=True)  # the same batch with the drafter detached ...
    assert arbiter.verdict(8) is None and arbiter.rates(8) == (None, pytest.approx(1200.0))  # measured again after it
    meter(True, 1000.0, 0.6)  # ... attached again (measured afresh: long enough to be called, goodput_tie_s)
    assert verdict() is False
    meter(False, 800.0)  # attached again for a while (say, before an exploration): detached steps still speak for plain
    assert verdict() is False
    clock.now += cfg.goodput_stale_s + 1  # the detached meter goes stale: attached plain's again
    meter(True, 1000.0)
    meter(False, 900.0)
    assert verdict() is True


def test_without_a_goodput_verdict_plain_is_settled_only_well_below_the_measured_cost_ratio():
    """The engine detaches at once on a settled plain verdict; where goodput has none yet, the cost model's
    answer settles it only with τ far below the ratio of measured step times, never on defaults."""
    policy = SpeculationPolicy(PolicyConfig(goodput=False))
    states = [RequestSpecState() for _ in range(8)]
    for state in states:
        for _ in range(10):
            policy.observe_round(state, 1)  # τ = 1: drafts never accepted

    def settled(drafting=states):
        policy.decide(8, drafting)  # (the engine asks right after the step's decision)
        return policy.plain_measured_faster(8)

    assert not settled()  # costs at this bucket not measured: no settling
    for _ in range(3):
        policy.observe_step(8, False, 1, 1e-3)
        policy.observe_step(8, True, 1, 1.2e-3)  # ratio 1.2: τ 1 is below it, but not by 25 %
    assert not settled()
    for _ in range(16):
        policy.observe_step(8, True, 1, 2e-3)  # ratio 2
    assert settled()
    assert not settled([])  # nothing can draft: nothing to settle


def test_plain_is_not_settled_by_step_costs_that_measured_speculation_outruns():
    """Served, step times carry the server's share unevenly (the demo pair over REST at concurrency 1: rounds timed
    at 3.4 plain steps, τ 2.6, while speculation measured 2878 tok/s against plain's predicted 2222): where
    speculation's goodput is measured and plain's not, the cost model does not settle plain, however far its step
    costs put it ahead: plain must be measured too (goodput's verdict)."""
    clock = SimClock()

    def settled(spec_tok_s):
        policy = SpeculationPolicy(PolicyConfig(), clock=clock)
        states = [RequestSpecState() for _ in range(8)]
        for state in states:
            for _ in range(10):  # the model: τ 1.5 (τ 1, rounds of one token, would settle plain on its own) ...
                policy.observe_round(state, 1.5)
        for _ in range(16):
            policy.observe_step(8, False, 1, 1e-3)
            policy.observe_step(8, True, 1, 2e-3)  # ... against a ratio of 2: far below it
        for _ in range(30):  # speculation's goodput measured, plain's not
            clock.now += 0.01
            policy.goodput.observe(8, True, round(spec_tok_s * 0.01), 0.01)
        assert policy.goodput.rates(8) == (pytest.approx(spec_tok_s), None)
        assert not policy.decide(8, states, True)  # the model says plain (measured as it goes) ...
        return policy.plain_measured_faster(8)  # ... but is it settled?

    assert not settled(9000.0)  # measured above plain's predicted 8 / 1 ms = 8000 tok/s
    assert not settled(7000.0)  # below it, but not by the margin
    # far below it: still not settled — served, plain steps were predicted 1.5x faster than they measured (the demo pair
    # over REST at batch 4: 9.5k predicted, detached against speculation's measured 6.4k); only goodput's verdict settles
    assert not settled(4000.0)


def test_an_exploration_of_plain_steps_against_a_speculation_verdict_never_detaches_the_drafter():
    """Goodput measured speculation 2x faster while the cost model says plain: the arbiter's short epochs of
    plain steps (explorations) must not count as a settled plain verdict, or the drafter detaches every few seconds."""
    from tandem.speculative.attachment import DrafterAttachment

    clock = SimClock()
    policy = SpeculationPolicy(PolicyConfig(), clock=clock)
    states = [RequestSpecState() for _ in range(8)]
    for state in states:
        for _ in range(10):
            policy.observe_round(state, 1)  # the model: τ 1
    for _ in range(16):
        policy.observe_step(8, False, 1, 1e-3)
        policy.observe_step(8, True, 1, 2e-3)  # ratio 2: the model says plain
    for _ in range(30):  # measured: speculating makes twice the tokens per second
        clock.now += 0.01
        policy.goodput.observe(8, True, 20, 0.01)
        policy.goodput.observe(8, False, 10, 0.01)
    attachment = DrafterAttachment(clock=clock)
    plain_steps = 0
    for _ in range(2000):
        clock.now += 0.005
        speculate = policy.decide(8, states, True)
        policy.goodput.observe(8, speculate, 20 if speculate else 10, 0.005)
        plain_steps += not speculate
        settled = not speculate and policy.plain_measured_faster(8)
        assert attachment.after_decision(speculate, True, True, settled) != "detach"
    assert plain_steps  # plain steps were explored


def test_explain_names_what_a_decision_weighed():
    """The detach log line's reasons: goodput measured each way at the batch's bucket, and the step costs."""
    policy = SpeculationPolicy(PolicyConfig(), clock=lambda: 0.0)
    assert "speculating - tok/s, plain - tok/s" in policy.explain(8)  # nothing measured yet
    for _ in range(20):
        policy.observe_goodput(8, True, 24, 0.01)
        policy.observe_goodput(8, False, 8, 0.005)
    text = policy.explain(8)
    assert "speculating 2400 tok/s, plain 1600 tok/s" in text, text
    assert "ms plain / round" in text


@pytest.mark.parametrize("seed", [0, 1])
def test_step_costs_alone_never_detach_a_drafter_whose_speculation_was_not_measured(seed):
    """The demo pair over REST at concurrency 1 (batch 1-2): served rounds were timed at 1.01 ms against plain steps'
    0.31 ms (ratio 3.3) while a round took 0.56 ms of the clients' time against a plain token's 0.38, at τ 2.9. After
    its warm-up rounds the cost model says plain (τ's bound 2.4 x 1.25 below 3.3); settling that before speculation's
    goodput was measured detached a head that paid 2x. Speculation must be measured first, soon, and then kept."""
    from tandem.speculative.attachment import DrafterAttachment

    n, tau, round_wall, plain_wall, round_seen, plain_seen = 2, 2.9, 0.56e-3, 0.38e-3, 1.01e-3, 0.31e-3
    rng = random.Random(seed)
    clock = SimClock()
    policy = SpeculationPolicy(clock=clock)
    for _ in range(3):  # the warm-up's seeds, skewed as served steps were
        policy.observe_step(n, False, 1, plain_seen)
        policy.observe_step(n, True, 1, round_seen)
    attachment = DrafterAttachment(clock=clock)
    states = [RequestSpecState() for _ in range(n)]
    tokens = 0
    while clock.now < 2.0:
        speculate = policy.decide(n, states)
        made = step_tokens(policy, states, speculate, rng, tau)
        policy.observe_step(n, speculate, 1, round_seen if speculate else plain_seen)
        seconds = (round_wall if speculate else plain_wall) * rng.uniform(0.95, 1.05)
        clock.now += seconds
        policy.observe_goodput(n, speculate, made, seconds)
        settled = not speculate and policy.plain_measured_faster(n)
        assert attachment.after_decision(speculate, True, True, settled) != "detach", (clock.now, policy.explain(n))
        tokens += made
    always = n * tau / round_wall
    assert tokens / clock.now >= 0.95 * always, (tokens / clock.now, always)


@pytest.mark.parametrize("tau, plain_wins", [(3.0, False), (1.0, True)])
def test_a_plain_decision_says_why(tau, plain_wins):
    """The verifier's stats line tallies plain steps by the policy's reason: where speculation pays, they are the
    goodput meter's explorations of plain (and a plain step now and then re-timing its cost); where it does not, the
    meter's verdict holds plain. A speculative decision has no reason."""
    policy = warmed_with_goodput()
    decide, seen = policy.decide, []

    def recorded(*args, **kwargs):
        speculate = decide(*args, **kwargs)
        seen.append(None if speculate else policy.plain_reason)
        assert (policy.plain_reason is None) == speculate
        return speculate
    policy.decide = recorded
    simulate(policy, 8, [tau], 4000, seed=3)
    reasons = Counter(why for why in seen[-2000:] if why is not None)
    assert set(reasons) <= {"measured", "exploring", "timing", "model"}, reasons
    if plain_wins:
        assert reasons["measured"] > 0.8 * sum(seen_is_plain is not None for seen_is_plain in seen[-2000:]), reasons
    else:
        assert reasons["exploring"] > 0 and reasons["measured"] == 0, reasons
    fresh = SpeculationPolicy()
    assert fresh.decide(8, []) is False and fresh.plain_reason == "no drafts"


def _plain_epochs(spec_lead: float, sizes: tuple, seconds: float = 60.0) -> int:
    """Drive a goodput arbiter as the engine does for ``seconds`` (simulated): speculation makes ``spec_lead`` times
    plain's tokens a second; the batch cycles through ``sizes``; → how many epochs of plain steps began."""
    from tandem.speculative.goodput import GoodputArbiter
    from tandem.speculative.policy import cost_bucket

    clock, cfg = SimClock(), PolicyConfig()
    arbiter = GoodputArbiter(cfg, cost_bucket, clock)
    epochs, last, k = 0, True, 0
    while clock.now < seconds:
        n = sizes[k % len(sizes)]
        k += 1
        speculative = arbiter.choose(n, True, lambda: 1 - 1 / spec_lead)
        epochs += last and not speculative
        last = speculative
        step_s = 0.003 if speculative else 0.001
        clock.now += step_s
        arbiter.observe(n, speculative, n * 1000 * step_s * (spec_lead if speculative else 1.0), step_s)
    return epochs


def test_plain_far_behind_is_measured_again_only_to_refresh_it():
    """Speculation's goodput is measured all along while it runs; plain's is a cost that moves with the load. So
    plain steps far behind (by ``goodput_close`` or more) get an epoch only every ``goodput_explore_max_s``, whatever
    the cost formula would allow — each switch back also breaks the queued runs and catches the drafter up — while
    modes about even are measured by the formula, often. An exploration is scheduled again at the bucket it began at,
    wherever the batch ended it (a batch between two buckets explored again at once on its way back)."""
    refreshes = math.ceil(60.0 / PolicyConfig().goodput_explore_max_s) + 1  # per bucket, the first one included
    assert _plain_epochs(1.5, (8,)) <= refreshes
    assert _plain_epochs(1.5, (5, 8)) <= 2 * refreshes  # buckets 4 and 8, each refreshed
    assert _plain_epochs(1.05, (8,)) > 3 * refreshes  # about even: measured often


def test_a_detached_reading_speaks_for_plain_only_a_few_seconds_after_it():
    """A detached reading is frozen while attached. Compared with speculation measured now, one from a faster stretch
    of a drifting host detached the drafter on a tie (the demo pair over REST at concurrency 1: speculating 3520 tok/s
    against a detached 3618 from ~20 s before, while plain then ran at ~2000). Past ``goodput_detached_stale_s`` plain
    is what attached plain steps measure (a probe may measure it detached again)."""
    from tandem.speculative.goodput import GoodputArbiter
    from tandem.speculative.policy import cost_bucket

    clock, cfg = SimClock(), PolicyConfig()
    arbiter = GoodputArbiter(cfg, cost_bucket, clock)

    def meter(speculative, tokens_per_s, detached=False):
        for _ in range(30):
            clock.now += 0.01
            arbiter.observe(1, speculative, tokens_per_s * 0.01, 0.01, detached)

    meter(False, 3618.0, detached=True)
    meter(False, 2500.0)  # attached plain (a service drafter's features shipped every step)
    meter(True, 3520.0)
    assert arbiter.rates(1) == (pytest.approx(3520.0), pytest.approx(3618.0))  # just measured: detached speaks
    assert cfg.goodput_detached_stale_s < 10.0 < cfg.goodput_stale_s
    clock.now += 10.0  # stale as a detached reading, not as a reading
    meter(True, 3520.0)
    meter(False, 2500.0)
    assert arbiter.rates(1) == (pytest.approx(3520.0, rel=1e-3), pytest.approx(2500.0, rel=1e-3))


def _arbiter_with_a_verdict(lead: float = 0.1):
    """A GoodputArbiter whose verdict at batch 8 is speculation, ``lead`` ahead of attached plain steps; → (it, its
    clock)."""
    from tandem.speculative.goodput import GoodputArbiter
    from tandem.speculative.policy import cost_bucket

    clock, cfg = SimClock(), PolicyConfig()
    arbiter = GoodputArbiter(cfg, cost_bucket, clock)
    for speculative, rate in ((True, 1000.0 * (1 + lead)), (False, 1000.0)):
        for _ in range(30):
            clock.now += 0.01
            arbiter.observe(8, speculative, rate * 0.01, 0.01)
    for _ in range(50):  # epochs until speculation is the verdict
        clock.now += cfg.goodput_epoch_s
        arbiter._epoch_steps = cfg.goodput_epoch_steps
        arbiter.choose(8, True, lambda: 0.1)
    assert arbiter.verdict(8) is True
    return arbiter, clock


def test_a_probe_needs_a_closer_race_where_attached_plain_steps_only_hold_features():
    """Speculation 10 % ahead of attached plain steps: with a drafter service (every plain step ships its features)
    detached plain steps may well be faster, so a probe measures them; with an in-process head, which only holds the
    features, they can hardly be 10 % faster, and a probe would cost the batch admitted meanwhile its drafts."""
    def arbiter_with_a_verdict():
        return _arbiter_with_a_verdict()[0]

    assert arbiter_with_a_verdict().take_probe(8, ships_features=True)
    assert not arbiter_with_a_verdict().take_probe(8, ships_features=False)
    assert PolicyConfig().goodput_probe_margin > 0.1
    # an in-process head is probed only where attached plain steps were timed to cost more (its warm-up does not time
    # them): a close race from a hard prompt's acceptance (the demo pair on the CPU at concurrency 1: speculation 301
    # tok/s, plain 288) is no reason to detach it
    close = _arbiter_with_a_verdict(lead=0.045)[0]
    assert not close.take_probe(8, ships_features=False) and not close.take_probe(8, ships_features=False, tax=0.01)
    assert _arbiter_with_a_verdict(lead=0.045)[0].take_probe(8, ships_features=True)
    assert arbiter_with_a_verdict().take_probe(8, ships_features=False, tax=0.2)
    from tandem.speculative.drafter import Eagle3Drafter
    from verifier.drafter_client import DrafterClient
    from verifier.in_process_head import GuardedHead

    assert DrafterClient.ships_features and not GuardedHead.ships_features and not Eagle3Drafter.ships_features


def test_explorations_are_spaced_by_time_served_not_by_idle_time():
    """Speculation 10 % ahead: plain is explored again once an exploration's loss is a small share of the time since,
    counted in served time — a pause between loads brings the next exploration no sooner (the demo pair's 4 s loads
    over REST each explored plain at their start, 20-80 plain steps)."""
    arbiter, clock = _arbiter_with_a_verdict()

    def step() -> bool:
        mode = arbiter.choose(8, True, lambda: 0.1)
        clock.now += 0.01
        arbiter.observe(8, mode, (1100.0 if mode else 1000.0) * 0.01, 0.01)
        return mode

    modes = [step() for _ in range(300)]
    assert False in modes  # explored while served
    while modes[-1] is not False:  # up to an exploration, and through it
        modes.append(step())
    while modes[-1] is False:
        modes.append(step())
    clock.now += 10.0  # a pause between loads (the readings stay fresh)
    after = [step() for _ in range(20)]
    assert all(after), after


def test_probes_are_spaced_by_time_served_not_by_idle_time():
    """A bucket is probed at most once in goodput_stale_s of traffic: loads seconds apart, idle between, each paid a
    probe of a second detached (a quarter of a 4 s load); idle time brings the next one no sooner, served time does."""
    arbiter, clock = _arbiter_with_a_verdict()
    cfg = arbiter.cfg
    assert arbiter.take_probe(8, ships_features=True)
    clock.now += 4 * cfg.goodput_stale_s  # idle: no steps
    for _ in range(30):  # a new load: both modes measured again, speculation 10 % ahead
        for speculative, rate in ((True, 1100.0), (False, 1000.0)):
            clock.now += 0.01
            arbiter.observe(8, speculative, rate * 0.01, 0.01)
    assert arbiter.verdict(8) is True and not arbiter.take_probe(8, ships_features=True)
    served = arbiter.served_s
    while arbiter.served_s - served < cfg.goodput_stale_s:  # 30 s of traffic later
        for speculative, rate in ((True, 1100.0), (False, 1000.0)):
            clock.now += 0.05
            arbiter.observe(8, speculative, rate * 0.05, 0.05)
    assert arbiter.verdict(8) is True and arbiter.take_probe(8, ships_features=True)


def test_one_probe_in_goodput_stale_s_of_serving_whatever_the_bucket():
    """A batch about the edge of two buckets (concurrency 64 served between 42 and 57 requests: buckets 32 and 64)
    was probed at each, a second detached apiece, within one 4 s load; a probe speaks for plain steps detached near
    that batch size, so the next waits goodput_stale_s of serving wherever the batch is."""
    arbiter, clock = _arbiter_with_a_verdict()
    cfg = arbiter.cfg
    for speculative, rate in ((True, 2200.0), (False, 2000.0)):  # the bucket of 16: speculation 10 % ahead too
        for _ in range(30):
            clock.now += 0.01
            arbiter.observe(16, speculative, rate * 0.01, 0.01)
    for _ in range(50):
        clock.now += cfg.goodput_epoch_s
        arbiter._epoch_steps = cfg.goodput_epoch_steps
        arbiter.choose(16, True, lambda: 0.1)
    assert arbiter.verdict(8) is True and arbiter.verdict(16) is True
    assert arbiter.take_probe(8, ships_features=True)
    assert not arbiter.take_probe(16, ships_features=True)
    served = arbiter.served_s
    while arbiter.served_s - served < cfg.goodput_stale_s:
        for speculative, rate in ((True, 2200.0), (False, 2000.0)):
            clock.now += 0.05
            arbiter.observe(16, speculative, rate * 0.05, 0.05)
    assert arbiter.take_probe(16, ships_features=True)


def test_a_batch_about_a_buckets_edge_is_measured_as_one_load():
    """Concurrency 64 served between 42 and 57 requests (the edge of buckets 32 and 64 is 45): its steps fed one
    bucket's meters, not two at half the readings each (each explored and probed apart); a batch that moves well
    past the edge takes the next bucket, and a first step the nearest."""
    from tandem.speculative.goodput import GoodputArbiter, StickyBuckets
    from tandem.speculative.policy import cost_bucket

    sticky = StickyBuckets(cost_bucket)
    assert sticky(42) == 32 and sticky(57) == 64  # nothing served yet: the nearest
    sticky.track(57)
    assert [sticky(n) for n in (42, 45, 50, 57, 64, 80)] == [64] * 6
    assert sticky(30) == 32 and sticky(120) == 128  # well past the edge (1.25 times): the next bucket
    sticky.track(30)
    assert sticky(42) == 32 and sticky(56) == 32 and sticky(60) == 64

    clock, cfg = SimClock(), PolicyConfig()
    arbiter = GoodputArbiter(cfg, cost_bucket, clock)
    for i in range(60):
        for speculative, rate in ((True, 1100.0), (False, 1000.0)):
            clock.now += 0.01
            arbiter.observe(57 if i % 2 else 42, speculative, rate * 0.01, 0.01)
    spec, plain = arbiter.rates(42)
    assert arbiter.rates(57) == (spec, plain) and spec == pytest.approx(1100.0) and plain == pytest.approx(1000.0)


def test_a_pause_in_the_traffic_ages_no_reading():
    """Readings go stale in served time: after a minute with nothing to serve (a user reading an answer) the verdict
    stands and the next request is not made to measure the slower mode again; 30 s of serving elsewhere does age them."""
    from tandem.speculative.goodput import GoodputArbiter
    from tandem.speculative.policy import cost_bucket

    clock, cfg = SimClock(), PolicyConfig()
    arbiter = GoodputArbiter(cfg, cost_bucket, clock)

    def serve(batch, speculative, tokens_per_s, seconds):
        for _ in range(int(seconds / 0.01)):
            clock.now += 0.01
            arbiter.observe(batch, speculative, tokens_per_s * 0.01, 0.01)

    serve(1, True, 2000.0, 0.3)
    serve(1, False, 1100.0, 0.3)
    for _ in range(50):  # epochs end: the verdict is taken
        clock.now += cfg.goodput_epoch_s
        arbiter._epoch_steps = cfg.goodput_epoch_steps
        arbiter.choose(1, True, lambda: 0.4)
    assert arbiter.verdict(1) is True
    clock.now += 120.0  # idle
    assert arbiter.verdict(1) is True and arbiter.rates(1)[1] == pytest.approx(1100.0)
    modes = []
    for _ in range(20):  # the next request: speculation on its verdict, no plain epoch to measure plain again
        modes.append(arbiter.choose(1, True, lambda: 0.4))
        serve(1, modes[-1], 2000.0, 0.01)
    assert all(modes) and arbiter.basis == "measured"
    serve(64, True, 30000.0, cfg.goodput_stale_s + 1)  # served at another bucket for a while: batch 1's readings age
    assert arbiter.verdict(1) is None


def test_an_exploration_spanning_a_pause_is_not_ended_by_it():
    """Epochs last in served time: an exploration that began just before a pause (a user reading an answer) goes on
    after it until it has measured its mode, where the pause's wall time ended it unmeasured."""
    from tandem.speculative.goodput import GoodputArbiter
    from tandem.speculative.policy import cost_bucket

    clock, cfg = SimClock(), PolicyConfig()
    arbiter = GoodputArbiter(cfg, cost_bucket, clock)

    def serve(speculative, tokens_per_s, seconds, step_s=0.01):
        for _ in range(round(seconds / step_s)):
            clock.now += step_s
            arbiter.observe(1, speculative, tokens_per_s * step_s, step_s)

    serve(True, 2000.0, 0.3)
    serve(False, 1100.0, 0.3)
    for _ in range(50):
        clock.now += cfg.goodput_epoch_s
        arbiter._epoch_steps = cfg.goodput_epoch_steps
        arbiter.choose(1, True, lambda: 0.4)
    assert arbiter.verdict(1) is True
    while arbiter.basis != "exploring":  # served on until plain's next exploration is due
        serve(arbiter.choose(1, True, lambda: 0.4), 2000.0, 0.01)
    serve(False, 1100.0, 0.002, step_s=0.001)  # its first two steps ...
    clock.now += 60.0  # ... then nothing to serve for a minute
    assert arbiter.choose(1, True, lambda: 0.4) is False and arbiter.basis == "exploring"


def test_a_bucket_without_a_verdict_favours_speculation_only_where_the_traffic_clears_its_cost_ratio():
    """Detached on a verdict at the full bucket (plain faster at 64), the batch falls to 8 as a wave of requests ends:
    with no verdict there, the traffic's τ against the cost ratio measured there decides whether a batch there should
    have the drafter back — τ 3 clears a ratio of 1.5 by far, τ 1.6 does not (settled_margin); a verdict reached at 8
    is the answer there, whatever τ says."""
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=0), clock=SimClock())
    clock = policy.goodput.clock
    for size, plain_s, spec_s in ((8, 0.001, 0.0015), (64, 0.002, 0.006)):
        for _ in range(5):
            policy.observe_step(size, False, 1, plain_s)
            policy.observe_step(size, True, 1, spec_s)

    def measure(size, spec_rate, plain_rate):
        for speculative, rate in ((True, spec_rate), (False, plain_rate)):
            for _ in range(30):
                clock.now += 0.01
                policy.observe_goodput(size, speculative, rate * 0.01, 0.01)
        for _ in range(200):  # epoch ends until a verdict
            clock.now += policy.cfg.goodput_epoch_s
            policy.goodput._epoch_steps = policy.cfg.goodput_epoch_steps
            policy.goodput.choose(size, True, lambda: 0.1)
            if policy.goodput.verdict(size) is not None:
                return policy.goodput.verdict(size)
        raise AssertionError("no verdict")

    def traffic(tau):
        for _ in range(400):
            policy.observe_round(RequestSpecState(), tau)

    assert measure(64, 30000.0, 40000.0) is False
    traffic(3)
    assert not policy.speculation_favoured(64)  # the verdict there stands
    assert policy.speculation_favoured(8) and policy.speculation_favoured(6)
    traffic(1.6)
    assert not policy.speculation_favoured(8)
    traffic(3)
    assert measure(8, 9000.0, 10000.0) is False
    assert not policy.speculation_favoured(8)


def test_steps_heard_together_leave_the_policy_as_steps_heard_one_by_one():
    """The engine hands a detached period's plain steps over a few at a time (tandem.engine.step_accounting): the
    step costs, goodput meters and counters after one ``observe_steps`` call equal those after a call per step, in
    order (the meters read on one clock: the clock is left still here)."""
    rng = random.Random(3)
    runs = [(rng.choice((1, 4)), rng.uniform(0.001, 0.003)) for _ in range(40)] + [(4, None), (1, None)]
    tokens = [(rng.randint(1, 8), rng.uniform(0.001, 0.003)) for _ in range(40)]
    one, many = (SpeculationPolicy(PolicyConfig(warmup_rounds=0), clock=SimClock()) for _ in range(2))
    for policy in (one, many):
        policy.observe_step(2, True, 4, 0.004, width=4)  # speculation measured before: reset by plain steps
        policy.observe_goodput(2, True, 9, 0.004)
    for steps, seconds in runs:
        one.observe_step(2, False, steps, seconds)
    for n, seconds in tokens:
        one.observe_goodput(2, False, n, seconds, detached=True)
    many.observe_steps(2, False, runs)
    many.observe_goodput_steps(2, False, tokens, detached=True)
    for runs_class in (True, False, None):
        assert many.step_time(2, False, runs=runs_class) == pytest.approx(one.step_time(2, False, runs=runs_class))
    assert (many.plain_steps_since_spec, many.spec_steps_since_plain) == (one.plain_steps_since_spec, 0)
    assert many.plain_steps_since_spec == sum(steps for steps, _ in runs)
    assert many.goodput.rates(2) == pytest.approx(one.goodput.rates(2))
    assert many.goodput.served_s == pytest.approx(one.goodput.served_s)
    assert many.samples_since(2, 4) == one.samples_since(2, 4) > 0  # plain steps served since the round
