"""Shorter chains at batch (tandem.speculative.chain_depth): the depth a speculating batch drafts is the one whose
expected tokens per round over its measured round time is highest — checked against the optimum computed here
from the acceptance law the rounds are drawn from and the simulated cost curves; and in an engine whose policy
sees wide verifies cost more, the chains shorten and the output stays target-only greedy."""

from __future__ import annotations

import collections
import math
import random

import pytest

from checkpoints import write_checkpoint
from helpers import target_only_greedy, torch_prompts
from proposers import CyclingChains, RandomTreeProposer
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling import SamplingParams
from tandem.speculative.chain_depth import TRIAL_STEPS, ChainDepth, chain_ladder
from tandem.speculative.spec_config import SpecConfig
from tandem.speculative.policy import PolicyConfig, RequestSpecState, SpeculationPolicy, cost_bucket
from tandem.speculative.round_times import RoundTimes
from tandem.speculative.tree import DraftTree

CHAIN = SpecConfig(3, 1, 4)


def test_the_ladder_is_every_shorter_chain_and_a_tree_keeps_its_shape():
    assert chain_ladder(CHAIN) == (SpecConfig(1, 1, 2), SpecConfig(2, 1, 3), CHAIN)
    assert chain_ladder(SpecConfig(4, 2, 6)) == (SpecConfig(4, 2, 6),)
    assert chain_ladder(SpecConfig(3, 1, 3)) == (SpecConfig(3, 1, 3),)  # a chain cut short by its flags: as given
    assert SpeculationPolicy(PolicyConfig(enabled=False)).ladder(CHAIN) == (CHAIN,)  # "always": the configured one
    assert SpeculationPolicy(PolicyConfig(shorter_chains=False)).ladder(CHAIN) == (CHAIN,)


def _expected_tokens(p: list[float], depth: int) -> float:
    """1 + sum over positions i <= depth of P(drafts 1..i all accepted), position i accepted with p[i-1]."""
    total, reach = 1.0, 1.0
    for q in p[:depth]:
        reach *= q
        total += reach
    return total


def _rounds(depth_model: ChainDepth, p: list[float], depth: int, n: int, rng: random.Random) -> None:
    for _ in range(n):
        accepted = 0
        while accepted < depth and rng.random() < p[accepted]:
            accepted += 1
        depth_model.observe(depth, accepted)


@pytest.mark.parametrize("p", [[0.8, 0.8, 0.8], [0.9, 0.5, 0.2], [1.0, 0.0, 0.0]])
def test_tokens_per_round_by_depth_match_the_acceptance_law(p):
    """From rounds at the full depth and at shorter ones, mixed: each depth's expected tokens per round."""
    rng, model = random.Random(1), ChainDepth(chain_ladder(CHAIN), window=100_000)
    for depth in (3, 1, 3, 2, 3):
        _rounds(model, p, depth, 4000, rng)
    for depth in (1, 2, 3):
        assert model.tokens_per_round(depth) == pytest.approx(_expected_tokens(p, depth), abs=0.03)


@pytest.mark.parametrize("p", [[0.8, 0.8, 0.8], [0.9, 0.5, 0.2], [1.0, 1.0, 0.0], [0.95, 0.9, 0.9]])
@pytest.mark.parametrize("cost", ["flat", "linear", "steep"])
def test_the_chosen_depth_makes_the_most_tokens_a_second(p, cost):
    """Batch 1: a wider verify costs what a narrow one does; batch 64: round time grows with the width, more or less
    steeply. The choice is the best depth under the law (or within the margin of it, where two are that close)."""
    curves = {"flat": lambda w: 1.0, "linear": lambda w: 0.5 + 0.25 * w, "steep": lambda w: 0.1 + 0.5 * w}
    round_time = curves[cost]
    rng, model = random.Random(2), ChainDepth(chain_ladder(CHAIN), window=100_000)
    _rounds(model, p, 3, 20_000, rng)
    rates = {d: _expected_tokens(p, d) / round_time(d + 1) for d in (1, 2, 3)}
    chosen = model.choose(64, round_time).num_steps
    assert rates[chosen] >= max(rates.values()) / (1 + model.margin) - 1e-3, (chosen, rates)
    if cost == "flat" and p[2] > 0:
        assert chosen == 3  # a verify's width is free: the longest chain


def test_depths_are_compared_by_rounds_of_one_class():
    """The configured chain's recent rounds were mostly lone ones (arrivals cut the runs short: 3 ms a round) while the
    shorter chains were last timed in runs (about 1 ms a round, as the configured chain's runs too): compared across
    those mixes the chain of 2 would look better; in runs — where every depth has samples — the chain of 3 is."""
    p = [0.8, 0.8, 0.8]
    policy = SpeculationPolicy()
    for _ in range(8):
        policy.observe_step(8, True, 4, 4 * 1.0e-3, width=4)  # runs of 4 rounds
        policy.observe_step(8, True, 1, 3.0e-3, width=4)  # lone rounds
        policy.observe_step(8, True, 4, 4 * 0.95e-3, width=3)
        policy.observe_step(8, True, 4, 4 * 0.9e-3, width=2)
    policy.chain_spec(8, CHAIN)  # (the depth model starts)
    _rounds(policy.depth, p, 3, 4000, random.Random(4))
    rates = {d: _expected_tokens(p, d) / t for d, t in ((3, 1.0), (2, 0.95), (1, 0.9))}
    assert max(rates, key=rates.get) == 3
    mixed = _expected_tokens(p, 3) / (1e3 * policy.step_time(8, True, width=4))  # (the mix: 1.4 ms a round)
    assert mixed < rates[2]  # ... across mixes the chain of 2 would win
    assert policy.chain_spec(8, CHAIN) == CHAIN


def test_a_depth_is_kept_within_the_margin_weighed_every_few_steps_and_the_full_chain_explored():
    model = ChainDepth(chain_ladder(CHAIN), window=100_000, margin=0.05, explore_every=16, recheck_every=4)
    for _ in range(1000):
        model.observe(3, 1)  # always the first draft only: 2 tokens a round at every depth
    times = {2: 1.0, 3: 1.02, 4: 1.5}
    assert model.choose(8, times.get).num_steps == 1
    times[3] = 0.97  # depth 2 now 3 % ahead: inside the margin, depth 1 stays
    picks = [model.choose(8, times.get).num_steps for _ in range(40)]
    assert set(picks[:15]) == {1} and picks[15] == 3  # the full chain once, after explore_every steps at depth 1
    times[3] = 0.5  # far ahead: taken at the next weighing
    picks = [model.choose(8, times.get).num_steps for _ in range(5)]
    assert picks[-1] == 2 and picks[0] in (1, 2)
    # a bucket with only the full width measured: each shorter depth drafted in three trials of TRIAL_STEPS in a row to
    # time it; unmeasured still (the rounds were not timed), the full chain
    picks = [model.choose(1, {4: 1.0}.get).num_steps for _ in range(6 * TRIAL_STEPS + 4)]
    assert picks[: 6 * TRIAL_STEPS] == [1] * 3 * TRIAL_STEPS + [2] * 3 * TRIAL_STEPS and picks[-4:] == [3] * 4


def test_the_policy_weighs_each_width_apart_and_never_settles_on_an_unmeasured_one():
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=0))
    assert policy.chain_spec(64, CHAIN) == CHAIN  # nothing measured
    for width, seconds in ((4, 0.004), (2, 0.002)):
        for _ in range(3):
            policy.observe_step(64, True, 1, seconds, width=width)
    assert policy.step_time(64, True, width=4) == pytest.approx(0.004)
    assert policy.step_time(64, True, width=2) == pytest.approx(0.002)
    assert policy.step_time(64, True, width=3) is None
    for _ in range(500):
        policy.observe_round(RequestSpecState(), 2, depth=3)  # one draft kept of three
    # depth 2 unmeasured: drafted in three trials (TRIAL_STEPS each) to time it, which these steps do not
    picks = [policy.chain_spec(64, CHAIN) for _ in range(3 * TRIAL_STEPS + 7)]
    assert picks.count(SpecConfig(2, 1, 3)) == 3 * TRIAL_STEPS
    assert picks[-1] == SpecConfig(1, 1, 2)  # 2 tokens in 2 ms beat 2 in 4
    assert policy.step_time(64, True) == pytest.approx(0.002)  # the cost model now weighs the chain in use


class FirstDraftRight(RandomTreeProposer):
    """A chain whose first draft is the target's next token and whose later drafts are not."""

    def _tree(self, rid, size):
        full, pos = self.oracle[rid], len(self.tokens[rid])
        wrong = [(t + 1) % self.vocab for t in full[pos + 2 : pos + size]]
        return DraftTree.chain(full[pos], full[pos + 1 : pos + 2] + wrong)


class WideVerifiesCostMore(SpeculationPolicy):
    """Step times of a compute-bound batch, simulated: a round costs 0.5 + 0.25 x its width plain steps."""

    def step_time(self, batch_size, speculative, resumed=False, runs=None, width=None):
        if not speculative:
            return 1e-3
        if width is None:
            width = self.depth.chosen_width(cost_bucket(batch_size)) if self.depth is not None else (self.spec_width or 4)
        return 1e-3 * (0.5 + 0.25 * width)

    def samples_since(self, batch_size, width):
        return 0.0  # (these times hold at every step: never too old to weigh)

    def round_times(self, batch_size, width, runs):
        return [(self.step_time(batch_size, True, width=width), 1)] * self.cfg.step_samples


def test_an_engine_shortens_its_chains_where_wide_verifies_cost_more(tmp_path):
    path = tmp_path / "llama"
    write_checkpoint(path, "llama", seed=9, num_hidden_layers=2)
    prompts = torch_prompts(1, (6, 19, 11))
    ref = target_only_greedy(path, prompts, 96)
    oracle = {f"req-{i}": p + e + [0] * 8 for i, (p, e) in enumerate(zip(prompts, ref))}
    proposer = FirstDraftRight(vocab=256, seed=3, oracle=oracle)
    widths = []
    draft = proposer.draft
    proposer.draft = lambda rids, spec: (widths.append(spec.num_draft_tokens), draft(rids, spec))[1]
    policy = WideVerifiesCostMore(PolicyConfig(goodput=False, warmup_rounds=1))
    with LLMEngine(EngineConfig(model=str(path)), proposer=proposer, spec=CHAIN, policy=policy) as eng:
        out = eng.generate(prompts, SamplingParams(max_new_tokens=96, ignore_eos=True))
    assert [o.output_token_ids for o in out] == ref
    # 2 tokens a round at any depth: 2 / 1.0 at width 2 against 2 / 1.5 at width 4
    assert widths[0] == 4 and widths[-1] == 2 and widths.count(2) > 0.8 * len(widths)
    assert all(w in (2, 4) for w in widths)  # the full chain now and then (its later positions measured again)


def test_sampling_keeps_the_target_distribution_while_the_chain_changes(tmp_path):
    """Three sampled tokens, the rounds behind them drafted at depths that change every step: their joint law is the
    target's exactly (chi-square against the enumerated law, as for a fixed tree in test_spec_engine)."""
    from scipy.stats import chisquare
    from test_spec_engine import _exact_joint

    path = tmp_path / "tiny_vocab"
    hf = write_checkpoint(path, "llama", seed=5, num_hidden_layers=2, vocab_size=6)
    prompt, n, steps = [1, 4, 2, 5, 3], 3000, 3
    params = SamplingParams(temperature=1.0, max_new_tokens=steps, ignore_eos=True)
    policy = CyclingChains()
    with LLMEngine(EngineConfig(model=str(path), seed=7), proposer=RandomTreeProposer(vocab=6, seed=1), spec=CHAIN,
                   policy=policy) as eng:
        results = eng.generate([prompt] * n, params)
    assert policy.decisions >= 3 and sum(r.spec_stats.rounds for r in results) > n
    counts: dict[tuple, int] = {}
    for r in results:
        key = tuple(r.output_token_ids[:steps])
        counts[key] = counts.get(key, 0) + 1
    exact = _exact_joint(hf, prompt, params, steps)
    assert all(exact[k] > 0 for k in counts), "a token with zero target probability was emitted"
    cells = [k for k in exact if exact[k] * n >= 5]
    observed, expected = [counts.get(k, 0) for k in cells], [exact[k] * n for k in cells]
    if n - sum(expected) >= 1:
        observed.append(n - sum(observed))
        expected.append(n - sum(expected))
    p_value = chisquare(observed, [e * sum(observed) / sum(expected) for e in expected]).pvalue
    assert p_value > 1e-3, f"speculative samples do not follow the target distribution (p={p_value:.2e})"


def test_positions_a_shorter_chain_does_not_reach_keep_their_share():
    """Thousands of rounds at depth 1 say nothing of positions 2 and 3: their shares stay what full-depth rounds
    measured (not drift to the prior), so the depth is not pulled back by forgetting."""
    p, rng = [0.9, 0.3, 0.3], random.Random(4)
    model = ChainDepth(chain_ladder(CHAIN), window=256)
    _rounds(model, p, 3, 3000, rng)
    before = [model.tokens_per_round(d) for d in (1, 2, 3)]
    _rounds(model, p, 1, 20_000, rng)
    after = [model.tokens_per_round(d) for d in (1, 2, 3)]
    assert after == pytest.approx(before, abs=0.05)
    assert after[2] == pytest.approx(_expected_tokens(p, 3), abs=0.05)


# -- the whole policy (goodput, the speculate-or-not model, the depth) against simulated costs --------------------------
def _round_ms(n: int, width: int) -> float:
    """tests/test_spec_policy.py's round cost, by verify width: drafting and extending (fixed, per request, per draft),
    a verify of ``width`` rows per request that turns compute-bound as the batch grows."""
    return 4.0 + 0.2 * (width - 1) + 0.2 * n + 0.03 * width * n + 0.0025 * (width * n) ** 1.5


def _plain_ms(n: int) -> float:
    return 4.0 + 0.03 * n


def _simulate(n: int, p: list[float], steps: int, seed: int, fixed_depth: int | None = None,
              plain_ms=_plain_ms, round_ms=_round_ms, seeded_widths=(2, 3, 4), drift=None, count_from: int = 0,
              waits: float = 0.0) -> float:
    """Tokens per ms of a batch of ``n`` decoding for ``steps`` steps (those from ``count_from`` on): plain
    (``fixed_depth`` 0), one fixed chain (1-3 drafts), or the measured policy picking both (its goodput on a simulated
    clock; its step costs seeded as the warm-up does, round times of ``seeded_widths`` only). ``drift(step, width)``:
    a factor on served rounds' times (the warm-up's are as given). As in the engine, the two steps around a change of
    depth are not timed. ``waits``: the share of served steps whose time is doubled by a wait (the GIL, streaming)."""
    from policy_sim import SimClock

    rng = random.Random(seed)
    policy = SpeculationPolicy(PolicyConfig(), clock=SimClock())
    for size in (1, 2, 4, 8, 16, 32, 64):  # seeded as the warm-up does: every width at every bucket
        for _ in range(3):
            policy.observe_step(size, False, 1, plain_ms(size) / 1e3)
            for width in seeded_widths:
                policy.observe_step(size, True, 1, round_ms(size, width) / 1e3, width=width)
    policy.forget_traffic()
    states = [RequestSpecState() for _ in range(n)]
    tokens, spent, last_depth, untimed = 0, 0.0, fixed_depth or 3, 0
    for step in range(steps):
        if fixed_depth is None:
            depth = policy.chain_spec(n, CHAIN).num_steps if policy.decide(n, states) else 0
        else:
            depth = fixed_depth
        if depth and depth != last_depth:
            last_depth, untimed = depth, 2
        ms = (round_ms(n, depth + 1) * (drift(step, depth + 1) if drift else 1.0) if depth else plain_ms(n))
        ms *= rng.uniform(0.95, 1.05) * (2.0 if rng.random() < waits else 1.0)
        made = 0
        for state in states:
            accepted = 0
            while accepted < depth and rng.random() < p[accepted]:
                accepted += 1
            if depth:
                policy.observe_round(state, accepted + 1, depth)
            made += accepted + 1
        if step >= count_from:
            tokens, spent = tokens + made, spent + ms
        policy.goodput.clock.now += ms / 1e3
        if not untimed:
            policy.observe_step(n, bool(depth), 1, ms / 1e3, width=depth + 1 if depth else None)
            policy.observe_goodput(n, bool(depth), made, ms / 1e3)
        untimed = max(0, untimed - 1)
    return tokens / spent


@pytest.mark.parametrize("n", [1, 8, 64])
@pytest.mark.parametrize("p", [[0.9, 0.8, 0.7], [0.8, 0.4, 0.2], [0.95, 0.95, 0.95]], ids=["decaying", "steep", "high"])
def test_the_measured_policy_is_within_3_percent_of_the_best_fixed_setting(n, p):
    """Plain, and chains of 1, 2 and 3 drafts each run always: the policy — speculating or not by goodput and the
    cost model, its chain by acceptance per position and measured round times — makes at least 0.97 of the best."""
    steps = 600
    fixed = {depth: _simulate(n, p, steps, seed=0, fixed_depth=depth) for depth in (0, 1, 2, 3)}
    chosen = _simulate(n, p, steps, seed=0)
    assert chosen >= 0.97 * max(fixed.values()), (chosen, fixed)


def test_at_batch_64_a_shorter_chain_is_what_beats_the_configured_one():
    """The case the depth exists for: a large target at batch 64 (a plain step reads the weights; a round's verify
    adds compute by its width) with acceptance falling along the chain. A chain of 1 beats both plain decoding and the
    configured chain of 3 run always; the policy takes it."""
    def plain(n):
        return 10.0

    def round_(n, width):
        return 11.0 + 2.5 * (width - 1)

    p = [0.8, 0.4, 0.2]
    fixed = {depth: _simulate(64, p, 600, 1, depth, plain, round_) for depth in (0, 1, 3)}
    assert fixed[1] > 1.1 * fixed[3] and fixed[1] > 1.1 * fixed[0], fixed
    assert _simulate(64, p, 600, 1, None, plain, round_) >= 0.97 * fixed[1]


def test_a_depth_left_long_ago_is_timed_again_before_it_is_weighed_against_the_running_one():
    """Batch 1, where a verify's width is about free: rounds of every width cost 0.6 ms — but for the first 400 steps
    the full chain's cost 1.6 times that (a slow start: clocks, caches, the host), and the chain of 2 rightly took
    over. Once that passes, the full chain's old times must not keep it out: timed again, it wins back (the
    fixed full chain's rate, within 3 %, over the last steps)."""
    def plain(n):
        return 0.45

    def round_(n, width):
        return 0.6

    def slow_start(step, width):
        return 1.6 if step < 400 and width == 4 else 1.0

    p = [0.9, 0.8, 0.7]
    full = _simulate(1, p, 4000, 1, 3, plain, round_, drift=slow_start, count_from=2500)
    assert _simulate(1, p, 400, 1, None, plain, round_, drift=slow_start) > 1.05 * _simulate(
        1, p, 400, 1, 3, plain, round_, drift=slow_start)  # (the chain of 2 pays at the start)
    assert _simulate(1, p, 4000, 1, None, plain, round_, drift=slow_start, count_from=2500) >= 0.97 * full


def test_an_engine_not_warmed_up_times_the_shorter_chains_itself():
    """Only the configured chain's rounds timed (no warm-up seeded the shorter widths): the policy drafts a few steps
    at each shorter depth to time them, then takes the chain of 1 that wins at batch 64, as the warmed-up one does."""
    def plain(n):
        return 10.0

    def round_(n, width):
        return 11.0 + 2.5 * (width - 1)

    p = [0.8, 0.4, 0.2]
    best = _simulate(64, p, 600, 1, 1, plain, round_)
    assert _simulate(64, p, 600, 1, None, plain, round_, seeded_widths=(4,)) >= 0.97 * best
    model = ChainDepth(chain_ladder(CHAIN), recheck_every=1)
    for _ in range(100):
        model.observe(3, 3)
    picks = [model.choose(64, {4: 3e-3}.get).num_steps for _ in range(6 * TRIAL_STEPS + 2)]
    # each unmeasured depth tried three times (TRIAL_STEPS in a row each), then the measured one
    assert picks == [1] * 3 * TRIAL_STEPS + [2] * 3 * TRIAL_STEPS + [3, 3]


def test_a_change_of_depth_is_logged_once(caplog):
    import logging

    model = ChainDepth(chain_ladder(CHAIN), window=1000, recheck_every=1)
    for _ in range(100):
        model.observe(3, 1)
    with caplog.at_level(logging.INFO, logger="tandem.policy"):
        for _ in range(5):
            model.choose(64, {2: 1e-3, 3: 2e-3, 4: 3e-3}.get)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("batch bucket 64: chains of 1 draft now"), lines


def test_the_engines_capture_a_verify_width_for_every_chain_the_policy_may_draft(tmp_path):
    """In process (tandem.engine.speculative_setup) and in the drafter service's config: every chain of the ladder
    has its graphs; `always` keeps the configured one alone."""
    from draft_checkpoints import write_pair
    from tandem.engine.speculative_setup import speculative_engine, verify_widths

    write_pair(tmp_path, target_seed=1, draft_seed=2)
    cfg = EngineConfig(model=str(tmp_path / "target"))
    with speculative_engine(cfg, str(tmp_path / "draft"), CHAIN) as eng:
        assert eng.executor.runner.cfg.cuda_graph_widths == (1, 2, 3, 4)
    always = SpeculationPolicy(PolicyConfig(enabled=False))
    with speculative_engine(cfg, str(tmp_path / "draft"), CHAIN, policy=always) as eng:
        assert eng.executor.runner.cfg.cuda_graph_widths == (1, 4)
    assert verify_widths(chain_ladder(SpecConfig(4, 2, 6))) == (1, 6)


def test_after_a_change_the_new_depth_is_kept_for_a_few_weighings():
    """Each change of depth ends the queued run of rounds, and round times read just after one are the noisiest:
    depths about even must not take turns at every weighing. After a change the new depth stays ``dwell``
    weighings, whatever they read; then the margin rules again."""
    model = ChainDepth(chain_ladder(CHAIN), window=100_000, margin=0.03, explore_every=1000, recheck_every=1, dwell=2)
    for _ in range(1000):
        model.observe(3, 1)  # always the first draft only: 2 tokens a round at every depth
    times = {2: 1.0, 3: 1.5, 4: 1.5}
    assert model.choose(8, times.get).num_steps == 1  # a change (from the full chain): kept two weighings
    times[3] = 0.5  # depth 2 now far ahead
    assert [model.choose(8, times.get).num_steps for _ in range(3)] == [1, 1, 2]
    times[2] = 0.4  # depth 1 ahead again, just after the change to 2: kept two weighings, then back
    assert [model.choose(8, times.get).num_steps for _ in range(3)] == [2, 2, 1]


def test_a_batch_moving_between_buckets_does_not_change_depth_at_each_crossing():
    """A steady load's batch moves between two buckets all the time (requests end and arrive): here two steps at
    bucket 8, two at bucket 4. At bucket 8 the full chain makes 15 % more than the chain of 2; at bucket 4 the chain of
    2 is ahead (8 %, or twice). A change costs about a step's overlap, which two steps' gain does not pay back: once
    the stays are measured the depth stops changing at the crossings (at bucket 4, where its best is far ahead, that
    best)."""
    p = [0.9, 0.9, 0.5]
    for gain in (1.08, 2.0):
        model = ChainDepth(chain_ladder(CHAIN), window=100_000, margin=0.03, explore_every=1000, recheck_every=1)
        _rounds(model, p, 3, 4000, random.Random(5))
        tokens = {d: model.tokens_per_round(d) for d in (1, 2, 3)}
        costs = {8: {w: 1.0 for w in (2, 3, 4)}, 4: {2: 1.0, 3: 1.0, 4: tokens[3] / tokens[2] * gain}}
        assert [model.choose(4, costs[4].get).num_steps for _ in range(20)][-1] == 2  # (a long stay at 4 first)
        assert model.choose(8, costs[8].get).num_steps == 3
        picks = [model.choose(bucket, costs[bucket].get).num_steps for bucket in (8, 4, 4, 8) * 20]
        late = picks[20:]  # (the stays learnt: 2 steps at a time)
        assert len(set(late)) == 1, (gain, picks)
        assert gain < 2 or set(late) == {2}, (gain, picks)


def test_a_shorter_chain_is_taken_only_where_its_lead_stands_out_of_the_round_times_noise():
    """At batch 8 the chain of 2 makes 2.71 tokens a round and the full chain 3.12 (p 0.9, 0.9, 0.5); rounds 3 wide
    average 0.75 ms, 4 wide 1.0 ms: the chain of 2 leads by 8 %. Timed alike each round, that lead is taken; with each
    width's rounds scattering by ±40 % (sub-millisecond rounds served over REST), it is noise: the full chain stays."""
    p = [0.9, 0.9, 0.5]
    for scatter in (0.0, 0.4):
        rng = random.Random(7)
        policy = SpeculationPolicy(PolicyConfig(warmup_rounds=0))
        policy.chain_spec(8, CHAIN)  # (the depth model starts)
        _rounds(policy.depth, p, 3, 4000, random.Random(8))
        for _ in range(policy.cfg.step_samples):
            for width, ms in ((2, 0.9), (3, 0.75), (4, 1.0)):
                noisy = ms * (1 + scatter * rng.uniform(-1, 1))
                policy.observe_step(8, True, 4, 4 * noisy / 1e3, width=width)
        means = {w: policy.step_time(8, True, runs=True, width=w) for w in (3, 4)}
        lead = (policy.depth.tokens_per_round(2) / means[3]) / (policy.depth.tokens_per_round(3) / means[4])
        picks = [policy.chain_spec(8, CHAIN).num_steps for _ in range(24)]
        if scatter:
            assert lead > 1 + policy.depth.margin and set(picks) == {3}, (lead, picks)
        else:
            assert picks[-1] == 2, (lead, picks)


def test_a_short_trial_and_a_long_record_of_one_cost_read_alike():
    """Served, a step's time now and then holds a long wait (the GIL, streaming): here 1 ms a round, doubled on a
    quarter of the steps. The running width has its 16 latest steps, a trial has just timed 4 of another width that
    costs the same: every sample counted, none left out, they read alike on average (within 2 %); with the slowest of 4
    left out against the slowest of 16, the trial read about 8 % faster."""
    rng = random.Random(11)
    logs = []
    for _ in range(400):
        policy = SpeculationPolicy(PolicyConfig(warmup_rounds=0))
        for width, steps in ((4, 16), (3, 4)):
            for _ in range(steps):
                ms = 2.0 if rng.random() < 0.25 else 1.0
                policy.observe_step(8, True, 4, 4 * ms / 1e3, width=width)
        times = RoundTimes(policy, 8, chain_ladder(CHAIN))
        logs.append(math.log(times(3) / times(4)))
    assert abs(sum(logs) / len(logs)) < 0.02, sum(logs) / len(logs)


@pytest.mark.parametrize("n", [1, 8])
def test_served_waits_in_step_times_do_not_make_the_chain_change_depth(n):
    """A quarter of the served steps take twice as long (a wait for the GIL, a burst of streaming) at every width alike,
    and a wide verify costs what a narrow one does: the full chain makes the most tokens. The policy's trials time the
    shorter chains in a few steps each, which such waits make read fast or slow by chance: it must keep the full chain
    (within 3 % of it) rather than follow the noise (weighed on 3 steps each with no noise margin, depths took turns
    every tenth of a second over REST)."""
    def round_(size, width):
        return 1.0

    p = [0.9, 0.8, 0.7]
    full = _simulate(n, p, 6000, 5, 3, round_ms=round_, waits=0.25, count_from=1000)
    assert _simulate(n, p, 6000, 5, None, round_ms=round_, waits=0.25, count_from=1000) >= 0.97 * full


def test_a_depth_a_trial_found_far_behind_is_timed_again_ever_more_rarely(monkeypatch):
    """Batch 8, every width costing the same: the chains of 1 and 2 make 41 % and 18 % fewer tokens a round than the
    full chain. Each trial finds them far behind, so the next one comes twice as late as the last (up to 8 times): the
    shorter chains draft a third of the trial steps they drafted at the fixed spacing, and the rate is kept (served,
    each trial ends the queued runs twice, which this simulation does not charge)."""
    import tandem.speculative.chain_depth as chain_depth

    def round_(size, width):
        return 1.0

    picks = collections.Counter()
    run = ChainDepth._run
    monkeypatch.setattr(ChainDepth, "_run", lambda self, depth, transient=False: (picks.update([depth]),
                                                                            run(self, depth, transient))[1])
    p = [0.9, 0.8, 0.7]
    spaced = _simulate(8, p, 30000, 5, None, round_ms=round_)
    spaced_trials = picks[1] + picks[2]
    picks.clear()
    monkeypatch.setattr(chain_depth, "TRIAL_SPACING_MAX", 1)
    fixed = _simulate(8, p, 30000, 5, None, round_ms=round_)
    fixed_trials = picks[1] + picks[2]
    assert spaced_trials < 0.4 * fixed_trials, (spaced_trials, fixed_trials)
    assert spaced >= 0.995 * fixed


def test_a_depth_timed_on_one_step_is_timed_by_a_trial_before_it_is_chosen():
    """Served over REST, one step read a chain of 1 at 0.13 ms a round at bucket 4 where its rounds took over 1 ms, and
    the bucket switched to it at once. A time resting on fewer than MIN_TIMED_STEPS steps is unknown: a trial of that
    depth times it first, and with its true cost the full chain stays."""
    from tandem.speculative.step_costs import MIN_TIMED_STEPS

    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=0))
    policy.chain_spec(4, CHAIN)
    _rounds(policy.depth, [0.9, 0.9, 0.8], 3, 4000, random.Random(3))
    for _ in range(policy.cfg.step_samples):
        for width in (3, 4):
            policy.observe_step(4, True, 4, 4 * 1.0e-3, width=width)
    policy.observe_step(4, True, 4, 4 * 0.13e-3, width=2)  # (one step, read far too fast)
    assert RoundTimes(policy, 4, chain_ladder(CHAIN)).weighed_on(2) < MIN_TIMED_STEPS
    picks = []
    for _ in range(TRIAL_STEPS + 8):
        depth = policy.chain_spec(4, CHAIN).num_steps
        picks.append(depth)
        policy.observe_step(4, True, 4, 4 * 1.0e-3, width=depth + 1)  # (what a round of each width really costs)
    assert picks[:TRIAL_STEPS] == [1] * TRIAL_STEPS and set(picks[TRIAL_STEPS:]) == {3}, picks


def test_a_trial_is_weighed_against_the_running_depths_steps_just_before_it_not_a_slow_spell_before_those():
    """Served, step times drift in spells. At batch 1 every width costs about 0.55 ms a round (2.2 ms a step of 4
    rounds), but the full chain's 16 latest steps hold 11 from a slow spell (4-31 ms, as an H100's log over REST showed)
    before 5 normal ones; a trial of the chain of 2 then times 5 normal steps. Weighed against the full chain's whole
    record it reads about twice as fast and the bucket switched to it; weighed against the full chain's steps just
    before it (as many as the trial has), the two read alike and the full chain stays."""
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=0))
    policy.chain_spec(1, CHAIN)
    _rounds(policy.depth, [0.9, 0.9, 0.8], 3, 4000, random.Random(3))
    normal = [2.2, 1.65, 1.98, 2.29, 2.30, 2.33]
    spell = [4.07, 4.47, 4.49, 4.94, 6.11, 7.93, 14.4, 20.5, 31.1, 5.4, 8.2]
    for ms in normal:  # the chain of 1, timed long before
        policy.observe_step(1, True, 4, 1.3 * ms / 1e3, width=2)
    for ms in spell + normal[1:]:  # the running full chain
        policy.observe_step(1, True, 4, ms / 1e3, width=4)
    for ms in normal[1:]:  # a trial of the chain of 2, just now
        policy.observe_step(1, True, 4, ms / 1e3, width=3)
    times = RoundTimes(policy, 1, chain_ladder(CHAIN))
    assert 0.85 < times(3) / times(4) < 1.15, (times(3), times(4))
    picks = []
    for _ in range(16):
        depth = policy.chain_spec(1, CHAIN).num_steps
        picks.append(depth)
        policy.observe_step(1, True, 4, 2.2e-3, width=depth + 1)
    assert set(picks) == {3}, picks


def test_a_bucket_the_batch_comes_into_during_a_trial_keeps_its_own_depth():
    """At concurrency 8 the batch moves between buckets 4 and 8. A trial at bucket 4 drafts chains of 1; the batch
    comes into bucket 8 meanwhile, where the two depths read within the noise of each other and the full chain is
    held. Bucket 8 must not take the trial's depth up as its own (over REST on an H100 it held chains of 2 for seconds
    that way, 2.0 drafts a round where the full chain made 10 % more): a trial's depth is no running depth."""
    model = ChainDepth(chain_ladder(CHAIN), window=100_000, margin=0.03, explore_every=1000, recheck_every=1)
    for _ in range(1000):
        model.observe(3, 3)  # every draft accepted: the full chain makes the most at equal times
    flat = {2: 1.0, 3: 1.0, 4: 1.0}
    assert model.choose(8, flat.get).num_steps == 3  # bucket 8 holds the full chain
    assert model.choose(4, flat.get).num_steps == 3

    def unmeasured_shorter(width):  # bucket 4: the chain of 1 is not measured, so a trial times it
        return None if width == 2 else 1.0

    assert model.choose(4, unmeasured_shorter).num_steps == 1  # the trial's first step
    even = {2: 0.5, 3: 1.0, 4: 1.0}  # bucket 8: the chain of 1 within noise of the full chain (1.5x the tokens)
    even_noisy = lambda width: even[width]
    even_noisy.spread = lambda width: 0.5
    assert model.choose(8, even_noisy).num_steps == 3


def test_a_bucket_the_batch_comes_into_after_an_exploring_step_keeps_its_own_depth():
    """Buckets 4 and 8 both hold the chain of 1; every 64th step at bucket 4 drafts the full chain once to measure the
    positions past it. The next step comes into bucket 8: it keeps its chain of 1, not the exploring step's depth."""
    model = ChainDepth(chain_ladder(CHAIN), window=100_000, margin=0.03, explore_every=2, recheck_every=1000)
    for _ in range(1000):
        model.observe(3, 0)  # the first draft never kept: the chain of 1 makes as many tokens as longer ones
    cheap_short = {2: 0.5, 3: 0.75, 4: 1.0}
    cheap_noisy = lambda width: cheap_short[width]
    cheap_noisy.spread = lambda width: 0.5
    assert model.choose(8, cheap_short.get).num_steps == 1 and model.choose(4, cheap_short.get).num_steps == 1
    picks = [model.choose(4, cheap_noisy).num_steps for _ in range(2)]
    assert picks[-1] == 3  # the exploring step
    assert model.choose(8, cheap_noisy).num_steps == 1


def test_an_outdone_depth_is_still_timed_now_and_then_and_taken_where_serving_makes_it_pay():
    """The greedy warm-up timed rounds 2, 3 and 4 wide alike, but served (sampled traffic: its work per verified row
    grows with the width) they cost 1.0 / 1.5 / 2.0 ms, and acceptance falls fast (0.6, 0.4, 0.3): the chain of 1
    makes over half as much again as the full chain. The cold start does not time it, a later trial does, and the
    policy takes it."""
    p = [0.6, 0.4, 0.3]
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=0))
    for width in (2, 3, 4):
        for _ in range(12):
            policy.observe_step(8, True, 4, 4e-3, width=width, seeded=True)
    policy.chain_spec(8, CHAIN)
    rng = random.Random(5)
    _rounds(policy.depth, p, 3, 4000, rng)
    served = {2: 1.0, 3: 1.5, 4: 2.0}
    picks = []
    for _ in range(3000):
        depth = policy.chain_spec(8, CHAIN).num_steps
        picks.append(depth)
        _rounds(policy.depth, p, depth, 8, rng)
        policy.observe_step(8, True, 4, 4 * served[depth + 1] * rng.uniform(0.95, 1.05) / 1e3, width=depth + 1)
    assert set(picks[:500]) == {3}, picks[:500]  # (not timed at the cold start)
    assert collections.Counter(picks[-500:])[1] > 400, collections.Counter(picks[-500:])


@pytest.mark.parametrize("seeded_ms", [{2: 0.48, 3: 0.61, 4: 0.56}, {2: 0.40, 3: 0.70, 4: 1.00}],
                         ids=["about-even", "wide-costs-more"])
def test_a_depth_a_longer_chain_beats_at_the_warm_ups_times_is_never_timed(seeded_ms):
    """The demo pair on an H100: the warm-up timed rounds 2, 3 and 4 wide at batch 8 at 0.48 / 0.61 / 0.56 ms — about
    even — and the full chain makes the most tokens a round. Serving only adds to each round, which cannot bring a
    shorter chain level, so the policy neither times (a trial drafts 6 steps at that depth, twice ending the queued
    runs) nor picks one: the full chain from the first step. Where the warm-up found wide rounds dearer (0.40 / 0.70 /
    1.00 ms: the chain of 1 ahead), trials time the shorter chains as before."""
    p = [0.9, 0.9, 0.8]
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=0))
    for width, ms in seeded_ms.items():
        for _ in range(12):
            policy.observe_step(8, True, 4, 4 * ms / 1e3, width=width, seeded=True)
    policy.chain_spec(8, CHAIN)
    _rounds(policy.depth, p, 3, 4000, random.Random(3))
    picks = []
    for _ in range(40):
        depth = policy.chain_spec(8, CHAIN).num_steps
        picks.append(depth)
        policy.observe_step(8, True, 4, 4 * seeded_ms[depth + 1] * 1.5e-3, width=depth + 1)  # (served: half again)
    if seeded_ms[4] < 0.6:
        assert set(picks) == {3}, picks
    else:
        assert 1 in picks, picks


def test_long_after_a_trial_the_running_width_is_read_from_its_whole_record():
    """Right after a trial of 4 steps the running width is read from its 4 steps just before it; once it has run on,
    from its whole record (16 steps), not from as few as that trial had."""
    policy = SpeculationPolicy(PolicyConfig(warmup_rounds=0))
    for width, steps in ((4, 16), (3, 4)):
        for _ in range(steps):
            policy.observe_step(8, True, 4, 4e-3, width=width)
    assert RoundTimes(policy, 8, chain_ladder(CHAIN)).weighed_on(4) == 4
    for _ in range(20):
        policy.observe_step(8, True, 4, 4e-3, width=4)
    times = RoundTimes(policy, 8, chain_ladder(CHAIN))
    assert times.weighed_on(4) == policy.cfg.step_samples and times.weighed_on(3) == 4


@pytest.mark.parametrize("n", [1, 8])
def test_spells_of_slow_steps_do_not_make_the_chain_change_depth(n):
    """Served step times drift in spells (an H100 over REST: the full chain's 16 latest steps held 9 of 4-31 ms among 7
    of ~2 ms): here spells of 10-40 steps, every width alike 2-6 times slower, about 40 % of the time, and a wide verify
    costs what a narrow one does. A trial that falls outside a spell while the running width's record holds one read
    the shorter chain cheap; weighed against the running width's steps just before it, the full chain stays (within 3 %
    of it)."""
    rng = random.Random(17)
    factor = []
    while len(factor) < 6000:
        calm, spell = rng.randint(15, 60), rng.randint(10, 40)
        factor += [1.0] * calm + [rng.uniform(2.0, 6.0)] * spell

    def round_(size, width):
        return 1.0

    p = [0.9, 0.8, 0.7]
    full = _simulate(n, p, 6000, 5, 3, round_ms=round_, drift=lambda k, w: factor[k], count_from=1000)
    chosen = _simulate(n, p, 6000, 5, None, round_ms=round_, drift=lambda k, w: factor[k], count_from=1000)
    assert chosen >= 0.97 * full, (chosen, full)
