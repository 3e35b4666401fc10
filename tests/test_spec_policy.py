"""The speculation policy decides for the running batch by tokens per second: against simulated,
batch-dependent costs and accept lengths it picks the better of speculating and not; in the engine a
batch is one forward of one width, plain steps run the target-only path, the drafter is kept in step
while off, and output never changes (greedy equals target-only decoding)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from checkpoints import write_checkpoint
from helpers import target_only_greedy, torch_prompts
from proposers import RandomTreeProposer, Spec
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling import SamplingParams
from tandem.speculative.policy import PolicyConfig, RequestSpecState, SpeculationPolicy, cost_bucket
from tandem.speculative.tree import DraftTree


# -- the policy against simulated costs ------------------------------------------------------------
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


# -- the policy in the engine ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy") / "llama"
    write_checkpoint(path, "llama", seed=9, num_hidden_layers=3)
    prompts = torch_prompts(1, (6, 19, 11))
    return path, prompts, target_only_greedy(path, prompts, 48)


class CountingProposer(RandomTreeProposer):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: dict[str, int] = {}

    def extend(self, items):
        for rid, _, _ in items:
            self.calls[rid] = self.calls.get(rid, 0) + 1
        super().extend(items)


class PerfectChains(RandomTreeProposer):
    """Always the target's own continuation: every draft accepted, optionally slow."""

    def __init__(self, *a, delay_s: float = 0.0, **kw):
        super().__init__(*a, **kw)
        self.delay_s = delay_s

    def _tree(self, rid, size):
        full, pos = self.oracle[rid], len(self.tokens[rid])
        return DraftTree.chain(full[pos], full[pos + 1 : pos + size])

    def draft(self, rids, spec):
        import time

        time.sleep(self.delay_s)  # a round whose fixed cost dwarfs a plain step (a tiny target on a GPU)
        return super().draft(rids, spec)


def _oracle(prompts, ref):
    return {f"req-{i}": p + e + [0] * 8 for i, (p, e) in enumerate(zip(prompts, ref))}


def _run(path, prompts, proposer, policy, **cfg):
    with LLMEngine(EngineConfig(model=str(path), **cfg), proposer=proposer, spec=Spec(5), policy=policy) as eng:
        return eng.generate(prompts, SamplingParams(max_new_tokens=48, ignore_eos=True))


class ForwardLog:
    """Every target forward's rows per sequence, by engine step."""

    def __init__(self, engine):
        self.steps: list[list[list[int]]] = []
        forward = engine.executor.runner.forward

        def logged(batch, *a, **kw):
            self.steps[-1].append([len(s.token_ids) for s in batch.seqs])
            return forward(batch, *a, **kw)

        engine.executor.runner.forward = logged


def _logged_generate(engine, prompts, spec_of=lambda i: "default"):
    log = ForwardLog(engine)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    rids = [engine.add_request(p, params, spec=spec_of(i)) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        log.steps.append([])
        engine.step()
    return [engine.requests.pop(r).output for r in rids], log.steps


def test_a_batch_where_some_requests_cannot_draft_is_one_forward_of_one_width(setup):
    """A request without speculation rides in a speculating batch as filler rows of the verify's width:
    every decode step is one target forward whose sequences all have the same width (what one captured
    graph takes), and outputs are target-only greedy."""
    path, prompts, ref = setup
    proposer = RandomTreeProposer(vocab=256, seed=2, oracle=_oracle(prompts, ref))
    always = SpeculationPolicy(PolicyConfig(enabled=False))
    with LLMEngine(EngineConfig(model=str(path)), proposer=proposer, spec=Spec(5), policy=always) as eng:
        outputs, steps = _logged_generate(eng, prompts, spec_of=lambda i: None if i == 1 else "default")
    assert outputs == [r[:40] for r in ref]
    decode_steps = steps[1:]  # the first step prefills all three
    assert decode_steps and all(len(forwards) == 1 for forwards in decode_steps)
    assert all(len(set(forwards[0])) == 1 for forwards in decode_steps), decode_steps
    assert max(max(f[0]) for f in decode_steps) == 5  # the speculating steps were verifies of width 5


def test_plain_steps_with_a_drafter_run_the_target_only_forwards(setup):
    """Speculation off for the batch: the engine with a drafter runs exactly the forwards of a
    target-only engine (runs of 4 queued decode steps of width 1), keeping the drafter's input for later."""
    path, prompts, ref = setup
    cfg = EngineConfig(model=str(path), decode_steps=4)
    with LLMEngine(cfg) as eng:
        target_only, target_steps = _logged_generate(eng, prompts)
    never = SpeculationPolicy(PolicyConfig(fixed_cost_ratio=1e6, warmup_rounds=0, explore_every=10**6))
    never.observe_round(RequestSpecState(), 1)  # known: nothing pays
    proposer = CountingProposer(vocab=256, seed=3)
    with LLMEngine(cfg, proposer=proposer, spec=Spec(5), policy=never) as eng:
        drafted, spec_steps = _logged_generate(eng, prompts)
        assert eng.drafts.held_bytes == 0  # finished requests hold nothing
    assert drafted == target_only == [r[:40] for r in ref]
    assert spec_steps == target_steps
    assert len(target_steps) < 20  # runs of several steps, not one step at a time
    assert all(proposer.calls[f"req-{i}"] == 1 for i in range(3)), proposer.calls  # the prompts only: the rest held


def test_a_prompt_arriving_while_the_batch_is_plain_waits_for_its_first_draft(setup):
    """Once the batch decodes plainly, a new request's prompt features are held with its plain steps'
    and reach the drafter in the one extend before its first draft, not at its prefill."""
    path, prompts, ref = setup
    proposer = CountingProposer(vocab=256, seed=4)
    first_extend: dict[str, int] = {}
    real_extend = proposer.extend

    def extend(items):
        for rid, tokens, _ in items:
            first_extend.setdefault(rid, len(tokens))
        real_extend(items)

    proposer.extend = extend
    # random drafts accept ~nothing (τ ≈ 1 < 5): off after the 8 warm-up rounds; explorations every 400 steps
    policy = SpeculationPolicy(PolicyConfig(fixed_cost_ratio=5.0))
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(path)), proposer=proposer, spec=Spec(5), policy=policy) as eng:
        early = eng.generate(prompts[:2], params)  # these find out: speculation does not pay here
        late_rid = eng.add_request(prompts[2], params)
        while eng.has_unfinished():
            eng.step()
        late = eng.requests.pop(late_rid)
    assert [r.output_token_ids for r in early] + [late.output] == ref
    assert all(r.spec_stats.rounds >= 4 for r in early)
    assert first_extend[early[0].rid] == len(prompts[0])  # extended at its prefill, while speculating
    assert late_rid not in first_extend and late.spec_stats.rounds == 0  # never drafted: never extended


def test_useless_drafts_are_switched_off_for_the_batch_and_output_is_unchanged(setup):
    path, prompts, ref = setup
    proposer = CountingProposer(vocab=256, seed=3)
    results = _run(path, prompts, proposer, SpeculationPolicy(PolicyConfig(fixed_cost_ratio=1.5)))
    assert [r.output_token_ids for r in results] == ref
    rounds = [r.spec_stats.rounds for r in results]
    # warm-up (8 rounds over 3 requests: 3 steps), then an exploration every ceil(16 x 1.5²) = 36 plain steps
    assert all(3 <= n <= 5 for n in rounds), rounds
    for r in results:  # the held plain steps reach the drafter in one extend before each exploration
        assert proposer.calls[r.rid] <= 1 + 2 * r.spec_stats.rounds, (proposer.calls[r.rid], r.spec_stats.rounds)
    always = _run(path, prompts, RandomTreeProposer(vocab=256, seed=3), SpeculationPolicy(PolicyConfig(enabled=False)))
    assert all(r.spec_stats.rounds >= 40 for r in always), "without the policy every step speculates"


def test_useful_drafts_stay_on_and_come_back_after_a_bad_stretch(setup):
    path, prompts, ref = setup
    oracle = _oracle(prompts, ref)

    class GoodThenBad(RandomTreeProposer):
        """Perfect chains except between tokens 8 and 24: the policy turns speculation off there,
        the drafter is kept in step, and an exploration brings it back on."""

        def _tree(self, rid, size):
            full, pos = self.oracle[rid], len(self.tokens[rid])
            if 8 <= pos - len(prompts[int(rid.split("-")[1])]) + 1 <= 24:
                return DraftTree.chain(full[pos], [(t + 1) % 256 for t in full[pos + 1 : pos + size]])
            return DraftTree.chain(full[pos], full[pos + 1 : pos + size])

    cfg = PolicyConfig(request_window_tokens=8, fixed_cost_ratio=1.5, explore_every=2)
    results = _run(path, prompts, GoodThenBad(256, oracle=oracle), SpeculationPolicy(cfg))
    assert [r.output_token_ids for r in results] == ref
    for r in results:
        accepted = r.spec_stats.accepted_per_round
        assert accepted[0] == 4  # on at first, accepting whole chains
        assert 0 in accepted  # the bad stretch was tried ...
        assert accepted[-1] == 4 or accepted[-2] == 4  # ... and speculation came back once drafts were good again


def test_measured_costs_turn_off_costly_speculation(setup):
    """Nothing but the measured step times decides: perfect drafts that make a round ~20x a plain step
    are switched off (τ = 5 cannot pay for it), cheap perfect drafts stay on."""
    path, prompts, ref = setup
    cfg = PolicyConfig(plain_probe_every=16)
    slow = SpeculationPolicy(cfg)
    results = _run(path, prompts, PerfectChains(256, oracle=_oracle(prompts, ref), delay_s=0.1), slow)
    assert [r.output_token_ids for r in results] == ref
    assert slow.step_time(3, False) is not None and slow.cost_ratio(3) > 5
    # (the warm-up's rounds and a probe, then one measured epoch: plain is settled by goodput's verdict, not the model)
    assert all(r.spec_stats.rounds <= 8 for r in results), [r.spec_stats.rounds for r in results]
    fast = SpeculationPolicy(cfg)
    results = _run(path, prompts, PerfectChains(256, oracle=_oracle(prompts, ref)), fast)
    assert [r.output_token_ids for r in results] == ref
    assert fast.step_time(3, False) is not None and fast.cost_ratio(3) < 5  # a plain step ran and was timed
    assert all(r.spec_stats.accept_length_mean > 4.5 for r in results)
    assert all(r.spec_stats.rounds >= 7 for r in results), "cheap perfect drafts keep speculating"


def test_held_features_are_sent_once_past_their_limit(setup, monkeypatch):
    """A long stretch of plain steps must not pile up features: past PENDING_LIMIT_BYTES (per request)
    or PENDING_TOTAL_LIMIT_BYTES (all requests) they go to the drafter in one extend, and holding
    starts over; a step that sent such a catch-up is not timed."""
    import tandem.engine.draft_link as draft_link

    path, prompts, ref = setup
    proposer = CountingProposer(vocab=256, seed=5)
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=1, explore_every=1000, fixed_cost_ratio=5.0))
    timed_steps = []
    real_observe = policy.observe_step
    policy.observe_step = lambda n, spec, steps=1, seconds=None, resumed=False, width=None: (
        seconds is not None and timed_steps.append(step_no - 1),  # a step is timed when the next one starts
        real_observe(n, spec, steps, seconds, resumed, width))
    with LLMEngine(EngineConfig(model=str(path)), proposer=proposer, spec=Spec(5), policy=policy) as eng:
        row_bytes = 3 * eng.model_config.hidden_size * 4  # float32 features on the CPU
        monkeypatch.setattr(draft_link, "PENDING_LIMIT_BYTES", 10 * row_bytes)
        monkeypatch.setattr(draft_link, "PENDING_TOTAL_LIMIT_BYTES", 24 * row_bytes)
        monkeypatch.setattr(draft_link, "UNTIMED_CATCH_UP_TOKENS", 5)
        flush_steps = []
        real_keep = eng.drafts.keep_in_step
        eng.drafts.keep_in_step = lambda items: real_keep(items) and (flush_steps.append(step_no) or True)
        params = SamplingParams(max_new_tokens=48, ignore_eos=True)
        rids = [eng.add_request(p, params) for p in prompts]
        per_request, total = [], []
        step_no = 0
        while eng.has_unfinished():
            step_no += 1
            eng.step()
            per_request.append(max(eng.requests[r].pending_bytes for r in rids))
            total.append(eng.drafts.held_bytes)
        results = [eng.requests.pop(r) for r in rids]
    assert [r.output for r in results] == ref
    assert max(per_request) == 10 * row_bytes and max(total) <= 24 * row_bytes  # limits reached, never passed
    assert total[-1] == 0  # finished requests hold nothing
    assert flush_steps and not set(flush_steps) & set(timed_steps)
    assert len(timed_steps) >= step_no // 2
    for r in results:  # one warm-up round, then plain to the end: one extend per ~10 plain steps, not one each
        assert r.spec_stats.rounds == 1
        assert 4 <= proposer.calls[r.rid] <= 2 + 47 // 5, proposer.calls[r.rid]


def test_a_lost_drafter_leaves_nothing_held(setup):
    path, prompts, ref = setup
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=1, explore_every=1000, fixed_cost_ratio=5.0))
    with LLMEngine(EngineConfig(model=str(path)), proposer=CountingProposer(vocab=256, seed=7), spec=Spec(5),
                   policy=policy) as eng:
        rids = [eng.add_request(p, SamplingParams(max_new_tokens=48, ignore_eos=True)) for p in prompts]
        for _ in range(12):  # a warm-up round, then plain steps that hold their features
            eng.step()
        assert eng.drafts.held_bytes > 0
        eng.drafts.lost(RuntimeError("drafter gone"))
        assert eng.drafts.held_bytes == 0 and all(eng.requests[r].pending_bytes == 0 for r in rids)
        while eng.has_unfinished():
            eng.step()
        assert [eng.requests.pop(r).output for r in rids] == ref


def test_a_drafter_lost_and_back_before_the_next_step_gets_its_running_requests_back(setup):
    """A drafter service can drop and reconnect inside one step (its loss seen by the step's own call, its
    reconnection done by the next): the engine never sees it down at a step's start, yet every request's draft
    state is gone. The running requests are still recomputed onto it and speculate again, tokens unchanged."""
    path, prompts, ref = setup
    with LLMEngine(EngineConfig(model=str(path)), proposer=CountingProposer(vocab=256, seed=7), spec=Spec(5),
                   policy=SpeculationPolicy(PolicyConfig(enabled=False))) as eng:
        rids = [eng.add_request(p, SamplingParams(max_new_tokens=48, ignore_eos=True)) for p in prompts]
        for _ in range(3):
            eng.step()
        rounds = {r: eng.requests[r].spec_stats.rounds for r in rids}
        assert all(rounds.values()) and all(48 - len(eng.requests[r].output) >= 32 for r in rids)
        eng.proposer.available = False  # the connection fails inside a step ...
        eng.drafts.lost(RuntimeError("drafter gone"))
        eng.proposer.available = True  # ... and is back before the next one
        while eng.has_unfinished():
            eng.step()
        results = {r: eng.requests.pop(r) for r in rids}
    assert [results[r].output for r in rids] == ref
    assert all(results[r].spec_stats.rounds > rounds[r] for r in rids)


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


def _arbiter_with_a_verdict():
    """A GoodputArbiter whose verdict at batch 8 is speculation, 10 % ahead of attached plain steps; → (it, its clock)."""
    from tandem.speculative.goodput import GoodputArbiter
    from tandem.speculative.policy import cost_bucket

    clock, cfg = SimClock(), PolicyConfig()
    arbiter = GoodputArbiter(cfg, cost_bucket, clock)
    for speculative, rate in ((True, 1100.0), (False, 1000.0)):
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
    assert PolicyConfig().goodput_probe_margin_held < 0.1 < PolicyConfig().goodput_probe_margin
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
