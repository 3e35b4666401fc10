"""Detaching the drafter from a batch the policy keeps plain (tandem.speculative.attachment): when it
detaches and attaches again (a clock the test moves), and in the engine: once detached, no forward
captures features and the drafter gets no call — plain steps are target-only steps — requests prefilled
while detached stay plain, those admitted after attaching again speculate, and every token is the
target's."""

from __future__ import annotations

import pytest

from draft_checkpoints import pair_engine
from helpers import random_prompt
from tandem.sampling import SamplingParams
from tandem.speculative.attachment import AttachmentConfig, DrafterAttachment
from tandem.speculative.spec_config import SpecConfig


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


CFG = AttachmentConfig(detach_after_s=1.0, detach_after_steps=4, detached_first_s=2.0, detached_max_s=8.0,
                       ready_share=0.5, ready_timeout_s=3.0)


def _plain_steps(att: DrafterAttachment, clock: Clock, n: int, dt: float = 0.1) -> list:
    changes = []
    for _ in range(n):
        changes.append(att.after_decision(False, asked=True, can_switch=True))
        clock.now += dt
    return changes


def _until_detached(att: DrafterAttachment, clock: Clock, dt: float = 0.1, limit: int = 100) -> int:
    """Plain decisions every ``dt`` until one detaches (the clock stays at that moment); → how many."""
    for n in range(1, limit + 1):
        if att.after_decision(False, asked=True, can_switch=True) == "detach":
            return n
        clock.now += dt
    raise AssertionError("never detached")


def test_detaches_after_both_the_time_and_the_steps_and_backs_off():
    clock = Clock()
    att = DrafterAttachment(CFG, clock)
    assert _plain_steps(att, clock, 3, dt=1.0)[-1] is None  # a second passed, but 3 steps only
    assert att.after_decision(False, asked=True, can_switch=True) == "detach" and att.detached
    assert att.after_decision(False, asked=False, can_switch=True) is None  # 2 s detached
    clock.now += 2.0
    assert att.after_decision(False, asked=False, can_switch=True) == "attach" and not att.detached
    # attached again: the policy is not asked until half the batch can draft (or 3 s pass)
    assert not att.policy_may_decide(drafting=1, running=8)
    assert att.policy_may_decide(drafting=4, running=8)
    assert _until_detached(att, clock, dt=0.125) == 9  # 1 s of plain decisions again
    clock.now += 3.9  # the second detached period is twice the first
    assert att.after_decision(False, asked=False, can_switch=True) is None
    clock.now += 0.2
    assert att.after_decision(False, asked=False, can_switch=True) == "attach"


def test_attached_early_by_a_favoured_bucket_it_goes_back_to_the_period_at_any_other_until_that_ends():
    """A batch that falls to a favoured bucket attaches before its detached period ends; back at a bucket that is not
    favoured (the one whose plain verdict detached it) before that end, it detaches again at once — to the same
    period, not a doubled one — with no speculation measured there again; idle time moves that end as it moves the
    period's; once the period is over, a re-attach is an ordinary one."""
    clock = Clock()
    cfg = AttachmentConfig(detach_after_s=1.0, detach_after_steps=4, detached_first_s=4.0, detached_max_s=16.0,
                           favoured_attach_s=0.2)
    att = DrafterAttachment(cfg, clock)
    assert _until_detached(att, clock, dt=0.3) and att.detached
    period_end = clock.now + 4.0
    assert att.after_decision(False, asked=False, can_switch=True, spec_favoured=True) is None
    clock.now += 0.25
    assert att.after_decision(False, asked=False, can_switch=True, spec_favoured=True) == "attach"
    assert att.attached_early and not att.returns_detached(spec_favoured=True)
    clock.now += 0.5
    assert att.returns_detached(spec_favoured=False)  # the engine makes this step plain ...
    assert att.after_decision(False, asked=True, can_switch=True, spec_favoured=False, back=True) == "detach"
    assert att.detached and not att.attached_early
    clock.now = period_end - 0.01
    assert att.after_decision(False, asked=False, can_switch=True) is None  # the same period, not doubled
    clock.now = period_end + 0.01
    assert att.after_decision(False, asked=False, can_switch=True) == "attach" and not att.attached_early
    assert not att.returns_detached(spec_favoured=False)
    # early again, then an idle minute: the period's end moves with it
    assert _until_detached(att, clock, dt=0.3)
    period_end = clock.now + 8.0  # (doubled: the attach above ended a whole period)
    assert att.after_decision(False, asked=False, can_switch=True, spec_favoured=True) is None
    clock.now += 0.25
    assert att.after_decision(False, asked=False, can_switch=True, spec_favoured=True) == "attach"
    att.idle()
    clock.now += 60.0  # (asked first, as the engine asks: the idle minute is not part of the period)
    assert att.returns_detached(spec_favoured=False)
    assert att.after_decision(False, asked=True, can_switch=True, spec_favoured=False, back=True) == "detach"
    clock.now = period_end + 60.0 - 0.6
    assert att.after_decision(False, asked=False, can_switch=True) is None


def test_not_asked_or_under_a_speculative_run_it_does_not_detach():
    clock = Clock()
    att = DrafterAttachment(CFG, clock)
    for _ in range(20):
        assert att.after_decision(False, asked=False, can_switch=True) is None
        clock.now += 0.5
    for _ in range(20):
        assert att.after_decision(False, asked=True, can_switch=False) is None
        clock.now += 0.5
    assert att.after_decision(False, asked=True, can_switch=True) == "detach"


def test_short_explorations_keep_the_clock_and_earnest_speculation_resets_the_backoff():
    clock = Clock()
    att = DrafterAttachment(CFG, clock)
    _plain_steps(att, clock, 5, dt=0.15)
    assert att.after_decision(True, asked=True, can_switch=True) is None  # one exploring step
    assert "detach" in _plain_steps(att, clock, 5, dt=0.15)  # the plain clock kept running through it
    clock.now += 2.0
    att.after_decision(False, asked=False, can_switch=True)  # attached again
    assert att.policy_may_decide(4, 4)
    for _ in range(CFG.detach_after_steps):  # speculating in earnest: as many steps, for as long as a detach takes
        att.after_decision(True, asked=True, can_switch=True)
        clock.now += 0.5
    _until_detached(att, clock)
    clock.now += 2.0  # the first period again, not twice it
    assert att.after_decision(False, asked=False, can_switch=True) == "attach"


def test_plain_steps_that_only_measure_plain_do_not_run_the_detach_clock():
    """Explorations of plain steps (and steps timing one) while the policy speculates break a speculative streak but
    do not count towards detaching: served at concurrency 64, a load's first explorations at each bucket of its ramp
    added up to a second and 64 plain steps between streaks too short to reset the clock, and detached a drafter
    measured 53 % ahead. Plain steps the policy settles on still detach after the clock's second and steps."""
    clock = Clock()
    att = DrafterAttachment(CFG, clock)
    for _ in range(20):  # 6 s of 3 passing plain steps to 1 speculative one
        for _ in range(3):
            assert att.after_decision(False, asked=True, can_switch=True, passing=True) is None
            clock.now += 0.1
        assert att.after_decision(True, asked=True, can_switch=True) is None
        clock.now += 0.1
    assert not att.detached
    assert _until_detached(att, clock, dt=0.125) == 9  # 1 s of settled plain decisions, 0.125 s apart


def test_the_ready_gate_opens_after_its_timeout_and_pause_holds_everything():
    clock = Clock()
    att = DrafterAttachment(CFG, clock)
    _plain_steps(att, clock, 12)
    clock.now += 2.0
    assert att.after_decision(False, asked=False, can_switch=True) == "attach"
    assert not att.policy_may_decide(0, 8)
    clock.now += 3.0
    assert att.policy_may_decide(0, 8)
    att.pause()
    assert _plain_steps(att, clock, 30) == [None] * 30
    att.resume()
    assert "detach" in _plain_steps(att, clock, 12)


def test_held_detached_it_never_attaches_until_reset():
    clock = Clock()
    att = DrafterAttachment(CFG, clock)
    att.hold_detached()
    for asked in (False, True):
        clock.now += 1e6
        assert att.after_decision(True, asked=asked, can_switch=True) is None and att.detached
    att.reset()
    assert not att.detached


# -- in the engine -------------------------------------------------------------------------------
GREEDY = SamplingParams(max_new_tokens=14, ignore_eos=True)


class _Recorder:
    """The in-process drafter's calls, and whether each target forward captured features."""

    def __init__(self, eng):
        self.calls, self.captures = [], []
        drafter, forward = eng.proposer, eng.executor.forward
        for name in ("attach_prefix", "extend", "release", "draft", "flush"):
            setattr(drafter, name, self._counted(name, getattr(drafter, name)))

        def recorded(batch, *args, **kwargs):
            self.captures.append(batch.capture_features)
            return forward(batch, *args, **kwargs)
        eng.executor.forward = recorded

    def _counted(self, name, method):
        def call(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)
        return call


@pytest.mark.parametrize("cache", [True, False])
def test_a_detached_batch_runs_target_only_steps_and_later_arrivals_speculate(pair, cache):
    prompts = [random_prompt(700 + i, 9 + 3 * i) for i in range(6)]
    with pair_engine(pair, page_size=4, enable_prefix_caching=cache) as eng:
        reference = [r.output_token_ids for r in eng.generate(prompts, GREEDY)]
    clock = Clock()
    with pair_engine(pair, SpecConfig(3, 1, 4), page_size=4, enable_prefix_caching=cache) as eng:
        eng.attachment = DrafterAttachment(AttachmentConfig(detach_after_s=0.0, detach_after_steps=2,
                                                            detached_first_s=5.0), clock)
        speculate = [False]
        eng.policy.decide = lambda batch, drafting, runs=None: bool(drafting) and speculate[0]
        seen = _Recorder(eng)
        first = [eng.add_request(p, GREEDY) for p in prompts[:3]]
        while not eng.attachment.detached:
            eng.step()
        assert all(not eng.requests[r].draft_ready for r in first) and eng.drafts.held_bytes == 0
        assert seen.calls[-1] == "flush"  # the releases go out now (a drafter service's with a Round of their own)
        seen.calls.clear(), seen.captures.clear()
        speculate[0] = True  # the policy would speculate now, but nothing can draft while detached
        late = eng.add_request(prompts[3], GREEDY)  # prefilled while detached: plain to its end
        for _ in range(4):
            eng.step()
        assert seen.calls == [] and seen.captures and not any(seen.captures)
        assert not eng.requests[late].draft_ready
        clock.now += 5.0  # the detached period ends: prompts admitted from now on start on the drafter
        fresh = [eng.add_request(p, GREEDY) for p in prompts[4:]]
        while eng.has_unfinished():
            eng.step()
        got = [eng.requests[r].output for r in first + [late] + fresh]
        stats = {r: eng.requests[r].spec_stats.rounds for r in first + [late] + fresh}
    assert got == reference
    assert all(stats[r] == 0 for r in [late]) and all(stats[r] > 0 for r in fresh)


def _steered(eng, clock: Clock, detached_first_s: float, favoured: bool,
             decided_every_s: float = 0.0) -> tuple[list, list]:
    """The engine's attachment on ``clock`` (detaching after two plain steps; detached, asked again every step unless
    ``decided_every_s``), its policy steered by the test: → ([speculate], [favoured]), flags the test sets (speculate:
    whenever some request can draft; favoured: every bucket)."""
    eng.attachment = DrafterAttachment(AttachmentConfig(detach_after_s=0.0, detach_after_steps=2,
                                                        detached_first_s=detached_first_s, favoured_attach_s=0.2,
                                                        detached_decided_every_s=decided_every_s), clock)
    speculate, favour = [False], [favoured]
    eng.policy.decide = lambda batch, drafting, runs=None: bool(drafting) and speculate[0]
    eng.policy.speculation_favoured = lambda batch: favour[0]
    return speculate, favour


def test_idle_time_does_not_end_a_detached_period_and_a_favoured_batch_attaches_at_once(pair):
    """Detached, then the batch drains and the engine idles for a minute: the 5 s detached period stands still
    (loads apart in time would each pay a re-measurement), so the next prompt is prefilled plain; once requests
    run at a batch size whose last verdict was speculation, the engine attaches within ``favoured_attach_s`` of
    traffic and the prompt after that speculates."""
    greedy = SamplingParams(max_new_tokens=14, ignore_eos=True)
    prompts = [random_prompt(700 + i, 9 + 3 * i) for i in range(5)]
    clock = Clock()
    with pair_engine(pair, SpecConfig(3, 1, 4), page_size=4) as eng:
        speculate, favoured = _steered(eng, clock, detached_first_s=5.0, favoured=False)
        for p in prompts[:3]:
            eng.add_request(p, greedy)
        while not eng.attachment.detached:
            eng.step()
        while eng.has_unfinished():
            eng.step()
        speculate[0] = True
        clock.now += 60.0  # idle for a minute
        late = eng.add_request(prompts[3], greedy)
        eng.step()
        clock.now += 0.5
        eng.step()
        assert eng.attachment.detached  # a minute idle and half a second of traffic: the period goes on
        favoured[0] = True
        eng.step()
        assert eng.attachment.detached  # favoured, but not for 0.2 s yet
        clock.now += 0.25
        eng.step()
        assert not eng.attachment.detached
        fresh = eng.add_request(prompts[4], greedy)
        while eng.has_unfinished():
            eng.step()
        assert eng.requests[late].spec_stats.rounds == 0 and eng.requests[fresh].spec_stats.rounds > 0


def test_a_detached_engine_asks_again_whether_its_period_ends_only_every_so_often_or_at_another_batch(pair):
    """Detached, a step within ``detached_decided_every_s`` of the last decision at the same batch size asks nothing
    (host time a step at concurrency 1); a step after it, or at another batch size, asks again."""
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    clock = Clock()
    with pair_engine(pair, SpecConfig(3, 1, 4), page_size=4) as eng:
        _, favoured = _steered(eng, clock, detached_first_s=5.0, favoured=False, decided_every_s=0.01)
        asked = []
        real = eng.policy.speculation_favoured
        eng.policy.speculation_favoured = lambda batch: (asked.append(batch), real(batch))[1]
        first = eng.add_request(random_prompt(740, 11), greedy)
        while not eng.attachment.detached:
            eng.step()
        eng.step()
        asked.clear()
        for _ in range(3):  # the clock stands still: the decision of a moment ago stands
            eng.step()
        assert asked == []
        clock.now += 0.011
        eng.step()
        assert asked == [1]
        eng.add_request(random_prompt(741, 13), greedy)
        eng.step()  # (the prompt's step, alone)
        while len(eng.scheduler.running) < 2:
            eng.step()
        eng.step()
        assert asked[-1] == 2  # another batch size: asked at once
        favoured[0] = True
        clock.now += 0.25
        eng.step()
        clock.now += 0.25
        eng.step()
        assert not eng.attachment.detached and not eng.requests[first].finished


def test_a_detached_decision_stands_per_batch_size_while_the_batch_moves_between_sizes(pair):
    """Under arrivals the batch moves between a few sizes every few steps: a detached engine's decision at each size
    stands for ``detached_decided_every_s``, so going back to a size decided a moment ago asks nothing."""
    clock = Clock()
    with pair_engine(pair, SpecConfig(3, 1, 4), page_size=4) as eng:
        _steered(eng, clock, detached_first_s=5.0, favoured=False, decided_every_s=0.01)
        asked = []
        real = eng.policy.speculation_favoured
        eng.policy.speculation_favoured = lambda batch: (asked.append(batch), real(batch))[1]
        eng.add_request(random_prompt(742, 11), SamplingParams(max_new_tokens=40, ignore_eos=True))
        while not eng.attachment.detached:
            eng.step()
        clock.now += 0.011
        eng.step()
        eng.add_request(random_prompt(743, 9), SamplingParams(max_new_tokens=4, ignore_eos=True))
        while len(eng.scheduler.running) < 2:
            eng.step()
        while len(eng.scheduler.running) == 2:  # the short one decodes to its end; the clock stands still
            eng.step()
        eng.step()
        assert asked[-2:] == [1, 2] and asked.count(1) == 1  # back at batch 1: its decision of a moment ago stands
        clock.now += 0.011
        eng.step()
        assert asked[-1] == 1 and asked.count(1) == 2


def test_an_engine_attached_early_goes_back_detached_with_a_plain_step_at_a_bucket_not_favoured(pair):
    """Attached early by a favoured bucket, the engine speculates there; when the batch's bucket is not favoured
    before the detached period's end, that step is plain (no draft is asked for) and the drafter detaches again —
    and every request's tokens are still the target's."""
    greedy = SamplingParams(max_new_tokens=48, ignore_eos=True)  # (the first one joins: JOIN_MIN_TOKENS_LEFT to go)
    prompts = [random_prompt(720 + i, 9 + 2 * i) for i in range(4)]
    with pair_engine(pair, None, page_size=4) as plain_eng:
        reference = [r.output_token_ids for r in plain_eng.generate(prompts, greedy)]
    clock = Clock()
    with pair_engine(pair, SpecConfig(3, 1, 4), page_size=4) as eng:
        speculate, favoured = _steered(eng, clock, detached_first_s=30.0, favoured=True)
        first = eng.add_request(prompts[0], greedy)
        while not eng.attachment.detached:
            eng.step()
        speculate[0] = True
        eng.step()
        clock.now += 0.25
        eng.step()
        assert not eng.attachment.detached and eng.attachment.attached_early
        rest = [eng.add_request(p, greedy) for p in prompts[1:]]
        for _ in range(8):  # (the policy is asked once the batch can draft: the joins and the new prompts' first step)
            eng.step()
            if eng.speculating:
                break
        assert eng.speculating  # at its favoured bucket
        favoured[0] = False
        drafted = eng.proposer.draft
        calls = []
        eng.proposer.draft = lambda *a, **k: calls.append(1) or drafted(*a, **k)
        eng.step()
        assert eng.attachment.detached and not eng.speculating and eng.plain_reason == "detached" and not calls
        while eng.has_unfinished():
            eng.step()
        assert [eng.requests[r].output for r in [first, *rest]] == reference


def test_a_detached_period_stands_still_while_idle_and_a_favoured_bucket_ends_it():
    clock = Clock()
    att = DrafterAttachment(CFG, clock)
    _until_detached(att, clock)
    att.idle()
    clock.now += 100.0
    assert att.after_decision(False, asked=False, can_switch=True) is None  # traffic again: 2 s of it to go
    clock.now += 1.9
    assert att.after_decision(False, asked=False, can_switch=True) is None
    clock.now += 0.1
    assert att.after_decision(False, asked=False, can_switch=True) == "attach"
    _until_detached(att, clock)  # (the next period: 4 s)
    for favoured in (True, True, False, True, True, True):  # a favoured bucket for favoured_attach_s in a row
        assert att.after_decision(False, asked=False, can_switch=True, spec_favoured=favoured) is None
        clock.now += 0.1
    assert att.after_decision(False, asked=False, can_switch=True, spec_favoured=True) == "attach"
    att.hold_detached()
    clock.now += 10.0
    assert att.after_decision(False, asked=False, can_switch=True, spec_favoured=True) is None


def test_a_probe_is_not_cut_short_by_a_favoured_bucket():
    clock = Clock()
    att = DrafterAttachment(CFG, clock)
    assert att.after_decision(False, asked=True, can_switch=True, probe=True) == "detach"
    for _ in range(7):  # (steps of 1/8 s: exact in binary)
        clock.now += 0.125
        assert att.after_decision(False, asked=False, can_switch=True, spec_favoured=True) is None
    clock.now += 0.125
    assert att.after_decision(False, asked=False, can_switch=True, spec_favoured=True) == "attach"


def test_a_probe_taken_as_the_traffic_stops_ends_while_idle():
    """A probe measures plain steps now or not at all: idle, its second runs out (a detached period stands still)."""
    clock = Clock()
    att = DrafterAttachment(CFG, clock)
    assert att.after_decision(False, asked=True, can_switch=True, probe=True) == "detach"
    clock.now += 0.125
    att.idle()
    clock.now += 40.0
    assert att.after_decision(False, asked=False, can_switch=True) == "attach"


@pytest.mark.parametrize("lead, first_again", [(0.10, True), (0.02, False), (None, True)])
def test_earnest_speculation_restarts_the_backoff_only_well_ahead_of_plain(lead, first_again):
    """Modes about even (speculation 2 % ahead) must not restart the backoff: each re-attach then measures again."""
    clock = Clock()
    att = DrafterAttachment(CFG, clock)
    _until_detached(att, clock)
    clock.now += CFG.detached_first_s
    assert att.after_decision(False, asked=False, can_switch=True) == "attach"
    assert att.policy_may_decide(4, 4)
    for _ in range(CFG.detach_after_steps):  # as many speculative steps, for as long as a detach takes
        att.after_decision(True, asked=True, can_switch=True, spec_lead=lambda: lead)
        clock.now += 0.5
    _until_detached(att, clock)
    clock.now += CFG.detached_first_s
    attached = att.after_decision(False, asked=False, can_switch=True) == "attach"
    assert attached == first_again  # the first period again, or twice it


def test_a_measured_verdict_for_plain_steps_detaches_without_waiting_for_the_clock():
    clock = Clock()
    att = DrafterAttachment(CFG, clock)
    for _ in range(CFG.detach_measured_steps - 1):
        assert att.after_decision(False, asked=True, can_switch=True, plain_measured_faster=True, loss=0.2) is None
    # no time has passed: only the verdict could detach now
    assert att.after_decision(False, asked=True, can_switch=True, plain_measured_faster=True, loss=0.2) == "detach"
    clock.now += CFG.detached_first_s
    assert att.after_decision(False, asked=False, can_switch=True) == "attach"
    assert att.after_decision(False, asked=True, can_switch=False, plain_measured_faster=True) is None  # a run in flight


def test_a_close_measured_verdict_waits_out_the_clock():
    """Plain ahead by 1.8 % (a hard prompt's acceptance at concurrency 1): no quick detach — its cost, seconds of plain
    steps and requests admitted undrafted, outweighs such a loss, which the next prompt may reverse; the clock's time
    and steps still detach a batch kept plain."""
    clock = Clock()
    att = DrafterAttachment(CFG, clock)
    close = dict(asked=True, can_switch=True, plain_measured_faster=True, loss=0.018)
    assert CFG.detach_measured_loss > 0.018
    changes = []
    for _ in range(CFG.detach_measured_steps + 2):
        changes.append(att.after_decision(False, **close))
    assert changes == [None] * len(changes)
    clock.now += CFG.detach_after_s
    assert att.after_decision(False, **close) == "detach"


def test_by_default_the_policy_is_asked_again_only_once_the_whole_batch_can_draft():
    """An exploration with requests that cannot draft riding along as filler rows measures a diluted round."""
    clock = Clock()
    att = DrafterAttachment(clock=clock)
    while att.after_decision(False, asked=True, can_switch=True) != "detach":
        clock.now += 0.05
    clock.now += att.cfg.detached_first_s
    assert att.after_decision(False, asked=False, can_switch=True) == "attach"
    assert not att.policy_may_decide(drafting=7, running=8)
    assert att.policy_may_decide(drafting=8, running=8)


def test_requests_with_speculation_off_do_not_hold_the_ready_gate(pair):
    """Attached again, the policy is asked once every request that can speculate drafts: a request with
    speculation off never will, and must not keep the gate shut until its timeout."""
    prompts = [random_prompt(720 + i, 9 + 3 * i) for i in range(3)]
    clock = Clock()
    with pair_engine(pair, SpecConfig(3, 1, 4), page_size=4) as eng:
        eng.attachment = DrafterAttachment(AttachmentConfig(detach_after_s=0.0, detach_after_steps=2,
                                                            detached_first_s=5.0, ready_timeout_s=1e9), clock)
        asked = []
        eng.policy.decide = lambda batch, drafting, runs=None: asked.append(len(drafting)) or False
        plain = eng.add_request(prompts[0], SamplingParams(max_new_tokens=80, ignore_eos=True), spec=None)
        first = eng.add_request(prompts[1], GREEDY)
        while not eng.attachment.detached:
            eng.step()
        clock.now += 5.0
        eng.step()  # the detached period is over: attached again
        assert not eng.attachment.detached
        asked.clear()
        fresh = eng.add_request(prompts[2], GREEDY)
        while eng.requests[first].finish_reason is None or not eng.requests[fresh].output:
            eng.step()
        eng.step()
        assert eng.requests[plain].finish_reason is None
        assert any(asked), "the policy was not asked with the drafting request while the plain one ran"
