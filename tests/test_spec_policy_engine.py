"""The speculation policy in the engine: a batch is one forward of one width, plain steps run the target-only path,
the drafter is kept in step while off (features held and sent once), useless drafts are switched off for the batch and
useful ones come back, and output never changes (greedy equals target-only decoding)."""

from __future__ import annotations


import pytest

from checkpoints import write_checkpoint
from helpers import target_only_greedy, torch_prompts
from proposers import RandomTreeProposer, Spec
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling import SamplingParams
from tandem.speculative.policy import PolicyConfig, RequestSpecState, SpeculationPolicy
from tandem.speculative.tree import DraftTree


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
        eng.drafts.keep_in_step = lambda items, **kw: real_keep(items, **kw) and (flush_steps.append(step_no) or True)
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


class JoiningProposer(CountingProposer):
    """Takes requests that start on tokens it never saw (attach_prefix: their history, no features)."""

    caches_prefixes = True

    def attach_prefix(self, rid, tokens):
        self.tokens[rid] = list(tokens[1:])  # (its history of extended tokens: entry t is token t + 1)


def test_a_drafter_lost_and_back_before_the_next_step_gets_its_running_requests_back(setup):
    """A drafter service can drop and reconnect inside one step (its loss seen by the step's own call, its
    reconnection done by the next): the engine never sees it down at a step's start, yet every request's draft
    state is gone. The running requests still join it again and speculate, tokens unchanged."""
    path, prompts, ref = setup
    with LLMEngine(EngineConfig(model=str(path)), proposer=JoiningProposer(vocab=256, seed=7), spec=Spec(5),
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
