"""The engine's per-step bookkeeping (tandem.engine.step_accounting): what the policy hears of a step
and when, and the decoding owed after a step of prompts alone — on explicit times, no engine."""

from __future__ import annotations

import pytest

from tandem.engine.step import StepInfo
from tandem.engine.step_accounting import MAX_DECODE_OWED_S, StepAccounting

PROPOSER = object()


class Heard:
    def __init__(self):
        self.calls = []

    def observe_step(self, num_decode, speculative, steps, seconds, resumed=False, width=None):
        self.calls.append(("step", num_decode, speculative, steps, seconds, resumed))

    def observe_goodput(self, running, speculative, tokens, seconds, detached=False):
        self.calls.append(("goodput", running, speculative, tokens, seconds))

    def observe_arrivals(self, tokens, seconds):
        self.calls.append(("arrivals", tokens, seconds))

    def observe_steps(self, num_decode, speculative, runs):
        self.calls.append(("steps", num_decode, speculative, list(runs)))

    def observe_goodput_steps(self, running, speculative, steps, detached=False):
        self.calls.append(("goodput steps", running, speculative, list(steps), detached))


def decode(n=4, speculative=True, **kw):
    return StepInfo(num_prefill=0, num_decode=n, spans={}, speculative=speculative, **kw)


def test_a_step_is_timed_to_the_next_steps_start_and_heard_only_then():
    acc, policy = StepAccounting(prefill_apart=False), Heard()
    acc.step_ended(policy, decode(4, steps=2), started=10.0, ended=10.5, running_before=4, running_after=4,
                   speculating=True, proposer=PROPOSER, drafter_up=True, tokens=12)
    assert policy.calls == []  # not before the next step starts: what the caller does with the tokens counts
    acc.step_starts(11.0, policy)
    assert policy.calls == [("step", 4, True, 2, pytest.approx(1.0), False),
                            ("goodput", 4, True, 12, pytest.approx(1.0))]
    acc.step_starts(12.0, policy)
    assert len(policy.calls) == 2  # heard once


def test_a_step_with_prompts_or_before_idling_is_not_timed_and_a_catch_up_round_is_apart():
    acc, policy = StepAccounting(prefill_apart=False), Heard()
    mixed = StepInfo(num_prefill=1, num_decode=3, spans={}, speculative=True, prefill_tokens=50)
    acc.step_ended(policy, mixed, 0.0, 0.1, 3, 4, True, PROPOSER, True, 4)
    acc.step_starts(1.0, policy)
    assert policy.calls[0] == ("step", 3, True, 1, None, False)
    policy.calls.clear()
    acc.step_ended(policy, decode(2), 1.0, 1.1, 2, 0, True, PROPOSER, True, 2)  # the last requests finished
    acc.step_starts(5.0, policy)
    assert policy.calls == [("step", 2, True, 1, None, False)]  # an idle gap is no step's cost; no goodput
    policy.calls.clear()
    acc.step_ended(policy, decode(2, timed=False), 5.0, 5.2, 2, 2, True, PROPOSER, True, 4)
    acc.step_starts(5.5, policy)
    # timed apart for the cost model; no goodput: a catch-up is a switch's price, not the mode's pace
    assert policy.calls == [("step", 2, True, 1, pytest.approx(0.5), True)]
    policy.calls.clear()
    # a plain step that flushed held input to the drafter: plain mode's own recurring cost, in its goodput
    acc.step_ended(policy, decode(2, speculative=False, timed=False), 6.0, 6.2, 2, 2, False, PROPOSER, True, 2)
    acc.step_starts(6.5, policy)
    assert ("goodput", 2, False, 2, pytest.approx(0.5)) in policy.calls


def test_arrivals_are_charged_from_prompts_alone_while_speculating_with_a_drafter():
    prompts = StepInfo(num_prefill=2, num_decode=0, spans={"draft_extend": (0, 3_000_000)}, prefill_tokens=64)
    for speculating, up, heard in ((True, True, True), (False, True, False), (True, False, False)):
        acc, policy = StepAccounting(prefill_apart=False), Heard()
        acc.step_ended(policy, prompts, 0.0, 0.1, 0, 2, speculating, PROPOSER, up, 2)
        assert (("arrivals", 64, pytest.approx(0.003)) in policy.calls) == heard


def test_prompts_alone_go_to_goodput_only_as_their_extension_into_the_drafter_while_speculating():
    """A step of prompts alone beside running requests is paid in either mode: speculative goodput hears its drafter
    extension (3 ms, no tokens), plain goodput nothing; its wall time is no mode's (a wave's burst of prompt steps
    read as the pace of whichever mode it came in)."""
    prompts = StepInfo(num_prefill=2, num_decode=0, spans={"draft_extend": (0, 3_000_000)}, prefill_tokens=64)
    for speculating, heard in ((True, [("goodput", 4, True, 0, pytest.approx(0.003))]), (False, [])):
        acc, policy = StepAccounting(prefill_apart=True), Heard()
        acc.step_ended(policy, prompts, 0.0, 0.1, 4, 6, speculating, PROPOSER, True, 2)
        acc.step_starts(0.2, policy)
        assert [c for c in policy.calls if c[0] == "goodput"] == heard, speculating


def test_without_a_proposer_the_policy_hears_no_step():
    acc, policy = StepAccounting(prefill_apart=False), Heard()
    acc.step_ended(policy, decode(4, speculative=False), 0.0, 0.1, 4, 4, False, None, False, 4)
    acc.step_starts(1.0, policy)
    assert policy.calls == []


def test_prompts_kept_apart_leave_decoding_owed_as_long_as_they_took_capped_and_paid_by_decoding():
    acc, policy = StepAccounting(prefill_apart=True), Heard()
    prompts = StepInfo(num_prefill=1, num_decode=0, spans={}, prefill_tokens=10)
    acc.step_ended(policy, prompts, 0.0, 0.02, 3, 4, False, None, False, 1)
    assert acc.decode_owed_s == pytest.approx(0.02) and acc.after_prompts
    acc.step_ended(policy, decode(4), 0.5, 0.53, 4, 4, False, None, False, 4)  # the one step after prompts:
    assert acc.decode_owed_s == pytest.approx(0.02) and not acc.after_prompts  # it pays nothing, runs follow
    acc.step_ended(policy, decode(4), 1.0, 1.015, 4, 4, False, None, False, 4)
    assert acc.decode_owed_s == pytest.approx(0.005)
    acc.step_ended(policy, decode(4), 2.0, 2.015, 4, 4, False, None, False, 4)
    assert acc.decode_owed_s == 0.0
    acc.step_ended(policy, prompts, 3.0, 4.0, 3, 4, False, None, False, 1)  # a long chunk
    assert acc.decode_owed_s == MAX_DECODE_OWED_S
    idle = StepAccounting(prefill_apart=True)
    idle.step_ended(policy, prompts, 0.0, 0.02, 0, 1, False, None, False, 1)  # nobody was decoding: nothing owed
    assert idle.decode_owed_s == 0.0
    together = StepAccounting(prefill_apart=False)
    together.step_ended(policy, prompts, 0.0, 0.02, 3, 4, False, None, False, 1)
    assert together.decode_owed_s == 0.0


def test_prompts_queued_behind_a_run_are_timed_from_its_read_back():
    """A step that read a run back and then took the prompts queued behind it (tandem.engine.prompts_behind): what is
    owed after it and what the prefill pace hears are the prompts' time, from the run's read-back, not the run's."""
    acc, policy = StepAccounting(prefill_apart=True), Heard()
    behind = StepInfo(num_prefill=1, num_decode=0, spans={}, prefill_tokens=200, timed_from=0.03)
    acc.step_ended(policy, behind, 0.0, 0.034, 4, 5, False, None, False, 9)
    assert acc.decode_owed_s == pytest.approx(0.004) and acc.after_prompts
    assert list(acc.pace._prefill_s_per_token) == [pytest.approx(0.004 / 200)]


def test_the_steps_around_a_change_of_chain_depth_are_not_timed():
    """The step in which the chain's depth changed ends the old depth's queued runs and the next queues the new
    depth's first run with nothing to overlap it: neither is a round's cost (the engine says ``switched``), nor
    speculation's goodput (a burst of them would read as speculation far slower than it runs)."""
    acc, policy = StepAccounting(prefill_apart=False), Heard()
    acc.step_ended(policy, decode(4, steps=3, width=3), 0.0, 0.1, 4, 4, True, PROPOSER, True, 9, switched=True)
    acc.step_starts(0.2, policy)
    assert policy.calls == [("step", 4, True, 3, None, False)]
    acc.step_ended(policy, decode(4, steps=3, width=3), 0.2, 0.3, 4, 4, True, PROPOSER, True, 9)
    acc.step_starts(0.4, policy)
    assert policy.calls[1:] == [("step", 4, True, 3, pytest.approx(0.2), False),
                                ("goodput", 4, True, 9, pytest.approx(0.2))]


def test_a_speculative_step_whose_batch_could_not_all_draft_is_not_speculations_goodput():
    """Requests admitted while the drafter was detached cannot draft until they finish: a speculative step with them
    is not speculation's pace (its step time still counts); a plain step with them is plain's goodput."""
    acc, policy = StepAccounting(prefill_apart=False), Heard()
    acc.step_ended(policy, decode(4, steps=3, width=3), 0.0, 0.1, 4, 4, True, PROPOSER, True, 9, undrafted=True)
    acc.step_starts(0.2, policy)
    assert policy.calls == [("step", 4, True, 3, pytest.approx(0.2), False)]
    acc.step_ended(policy, decode(4, speculative=False), 0.2, 0.3, 4, 4, False, PROPOSER, True, 4, undrafted=True)
    acc.step_starts(0.4, policy)
    assert policy.calls[1:] == [("step", 4, False, 1, pytest.approx(0.2), False),
                                ("goodput", 4, False, 4, pytest.approx(0.2))]


def test_a_detached_periods_plain_steps_are_heard_a_few_at_a_time_in_order_and_before_any_other_step():
    from tandem.engine.step_accounting import DETACHED_HANDOVER

    acc, policy = StepAccounting(prefill_apart=False), Heard()
    t = 0.0

    def step(running, tokens, detached=True, speculating=False, steps=4):
        nonlocal t
        acc.step_starts(t, policy)
        acc.step_ended(policy, decode(running, speculative=speculating, steps=steps), t, t + 0.001, running, running,
                       speculating, PROPOSER, True, tokens, detached=detached)
        t += 0.002

    for i in range(DETACHED_HANDOVER):  # the first is heard when the second starts
        step(2, 8 + i)
    assert policy.calls == []
    step(2, 99)  # the eighth is heard as this one starts: all eight at once, oldest first
    runs = [(4, pytest.approx(0.002))] * DETACHED_HANDOVER
    assert policy.calls == [("steps", 2, False, runs),
                            ("goodput steps", 2, False, [(8 + i, pytest.approx(0.002)) for i in range(8)], True)]
    policy.calls.clear()
    step(3, 7)  # the 99 is held
    assert policy.calls == []
    step(3, 12, detached=False, speculating=True)  # the 7, at another batch size: what was held first, then the 7 held
    assert policy.calls == [("steps", 2, False, [(4, pytest.approx(0.002))]),
                            ("goodput steps", 2, False, [(99, pytest.approx(0.002))], True)]
    policy.calls.clear()
    step(3, 12, detached=False, speculating=True)  # an attached speculative step: the held 7 first, then it as ever
    assert policy.calls == [("steps", 3, False, [(4, pytest.approx(0.002))]),
                            ("goodput steps", 3, False, [(7, pytest.approx(0.002))], True),
                            ("step", 3, True, 4, pytest.approx(0.002), False),
                            ("goodput", 3, True, 12, pytest.approx(0.002))]
