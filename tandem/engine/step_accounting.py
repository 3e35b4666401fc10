"""What the engine learns from a step once it has run: the decoding owed after a step of prompts alone,
and what the speculation policy (tandem.speculative.policy) is told of it.

- With prompts kept apart from running requests, the running ones are owed as much decoding as a step
  of prompts alone took (at most MAX_DECODE_OWED_S) before the next such step: prompts that arrive
  meanwhile wait and go together, so a prefill's fixed cost is paid once for several.
- A step's cost is timed from its start to the next step's: what the caller does with the tokens (a
  server streams them, per step) is part of what a step costs. So the policy hears of a step when the
  next one starts, and only when requests were still running after it.
- An arrival's extension into the drafter is charged while speculating, from a step of prompts alone.
- A step of prompts alone is paid in either mode (and emits the prompts' first tokens in either): only its extension
  of the prompts into the drafter is speculation's, and only that goes to goodput, as speculative seconds. (Metered
  whole, in the mode of the moment, a wave's burst of prompt steps read as that mode's pace: the demo pair as a
  service at the start of a concurrency-64 wave measured "speculating 3010 tok/s" against plain's 32477, and
  detached.) Steps that prefill and decode together are metered whole.
- Goodput (tokens over a step's seconds) leaves out a round that first caught the drafter up on held input:
  a switch's price, which the arbiter's short epochs must not take for speculation's pace. (A plain step that
  flushes held input to the drafter is plain mode's own recurring cost: it counts.)
- The step in which the chain's depth changed and the one after it are not timed, nor counted in goodput (where a
  burst of such steps after the policy shortened the chain read as speculation far below plain, and detached the
  drafter): the first ends the queued runs
  of the old depth (nothing queued behind it), the second queues the new depth's first run with nothing to overlap
  it; a depth run only now and then (the full chain explored while a shorter one is held) would be timed by such
  steps alone, slower than it runs.
- Nor is a speculative step's goodput counted while some of its batch's requests cannot draft (admitted while the
  drafter was detached, they hold no drafter state until they finish, and pay a verify's full width for one token):
  long requests keep the batch mixed past the attachment's ``ready_timeout_s``, and measured afresh on that mix
  speculation read far below its pace, detached the drafter again at once and admitted the next requests undrafted
  too (tests/test_spec_reattach.py).
- A detached period's plain decode steps reach the policy DETACHED_HANDOVER at a time, in order, with nothing
  else between (StepCosts.observe_steps, GoodputArbiter.observe_steps): told one by one they cost a served step
  ~15 µs of host (the demo target at concurrency 1, where target-only's whole bookkeeping is ~5), and a detached
  period decides nothing on them but whether it ends. Any other step hands over what is held first.
- Each step's cost also goes to the prefill pace (tandem.engine.prefill_pace), which cuts long prompts'
  chunks while requests decode.
"""

from __future__ import annotations

from typing import NamedTuple

from tandem.engine.prefill_pace import PrefillPace
from tandem.engine.step import StepInfo

MAX_DECODE_OWED_S = 0.05  # decoding owed after a step of prompts alone, at most (a long chunk is not held back long)
DETACHED_HANDOVER = 8  # a detached period's plain steps the policy hears of together (see the module)


class _TimedStep(NamedTuple):  # (tuples: made every step, a frozen dataclass cost ~3 us of host cold)
    num_decode: int
    speculative: bool
    steps: int  # decode steps or rounds the step ran
    started: float | None  # None: its time says nothing of a step's cost (prompts in it, or none left running)
    resumed: bool  # a round that first caught the drafter up
    width: int  # a speculative step's verify width


class _GoodputStep(NamedTuple):
    running: int
    speculative: bool
    tokens: int
    started: float
    detached: bool  # plain, with the drafter detached


class StepAccounting:
    """The policy is the caller's at each call (warm-up and benches swap the engine's)."""

    def __init__(self, prefill_apart: bool):
        self.prefill_apart = prefill_apart
        self.decode_owed_s = 0.0
        # A step of prompts alone just stalled the running requests: their next token comes after one step,
        # not after a run (a stream's gap across a chunk is the chunk plus what follows it before a token) — unless
        # their runs are one graph of sub-millisecond steps (decode_ahead._owes_one_step).
        self.after_prompts = False
        self._step: _TimedStep | None = None
        self._goodput: _GoodputStep | None = None
        # detached plain steps not yet heard: their batch size (running, decoding), (steps, seconds), (tokens, seconds)
        self._held_key: tuple[int, int] | None = None
        self._held_steps: list[tuple[int, float | None]] = []
        self._held_goodput: list[tuple[int, float]] = []
        self.pace = PrefillPace()

    def step_starts(self, now: float, policy) -> None:
        """The previous step's time, up to ``now``, goes to ``policy`` (a detached plain step's, with the few before
        it: see the module)."""
        s, g = self._step, self._goodput
        self._step = self._goodput = None
        if s is not None and g is not None and g.detached and not s.speculative and not s.resumed:
            key = (g.running, s.num_decode)
            if key != self._held_key:
                self.hand_over(policy)
                self._held_key = key
            self._held_steps.append((s.steps, None if s.started is None else now - s.started))
            self._held_goodput.append((g.tokens, now - g.started))
            if len(self._held_steps) >= DETACHED_HANDOVER:
                self.hand_over(policy)
            return
        self.hand_over(policy)
        if s is not None:
            policy.observe_step(s.num_decode, s.speculative, s.steps,
                                None if s.started is None else now - s.started, resumed=s.resumed, width=s.width)
        if g is not None:
            policy.observe_goodput(g.running, g.speculative, g.tokens, now - g.started, detached=g.detached)

    def hand_over(self, policy) -> None:
        """What ``policy`` has not heard yet of a detached period's plain steps."""
        if self._held_steps:
            running, decoding = self._held_key
            policy.observe_steps(decoding, False, self._held_steps)
            policy.observe_goodput_steps(running, False, self._held_goodput, detached=True)
            self._held_steps, self._held_goodput = [], []
        self._held_key = None

    def step_ended(self, policy, info: StepInfo, started: float, ended: float, running_before: int,
                   running_after: int, speculating: bool, proposer, drafter_up: bool, tokens: int,
                   detached: bool = False, switched: bool = False, undrafted: bool = False) -> None:
        """``info`` of the step that ran from ``started`` (or ``info.timed_from``) to ``ended``, with
        ``running_before`` requests decoding as it began and ``running_after`` as it ended; ``speculating``: the
        batch's decision; ``proposer``: the engine's (None: the policy has nothing to learn); ``tokens``: what it
        emitted; ``detached``: the drafter was (tandem.speculative.attachment); ``switched``: the chain's depth changed
        in this step or the one before (not timed); ``undrafted``: some of the batch's requests could not draft (see
        the module)."""
        took = ended - (started if info.timed_from is None else info.timed_from)
        self.pace.observe(info, took)
        if self.prefill_apart:
            if info.num_prefill and not info.num_decode and running_before:  # prompts kept apart
                self.decode_owed_s = min(took, MAX_DECODE_OWED_S)
                self.after_prompts = True
            elif info.num_decode:
                # The one step right after prompts leaves what is owed: runs follow it (a cheap prompt step
                # would otherwise be paid by that step alone, and short arrivals alternate with single steps).
                # A whole run there (runs in one graph: decode_ahead._owes_one_step) is decoding like any other.
                if not self.after_prompts or info.steps > 1:
                    self.decode_owed_s = max(0.0, self.decode_owed_s - took)
                self.after_prompts = False
        if info.prefill_tokens and not info.num_decode and speculating and drafter_up:
            # prompts alone, their features extended into the drafter: what an arrival costs only while speculating
            policy.observe_arrivals(info.prefill_tokens, info.seconds.get("draft_extend", 0.0))
        if proposer is None:
            return
        resumed = info.speculative and not info.timed  # a round that first caught the drafter up: timed apart
        if info.num_decode:
            timed = (info.timed or resumed) and not info.num_prefill and running_after > 0 and not switched
            self._step = _TimedStep(info.num_decode, info.speculative, info.steps, started if timed else None, resumed,
                                    info.width)
        mode = info.speculative if info.num_decode else speculating
        if running_before and running_after and not resumed and not switched and not (mode and undrafted):
            # (not the last step before idling; nor a drafter's catching up, nor a change of depth: their price)
            if info.num_decode:
                self._goodput = _GoodputStep(running_before, mode, tokens, started, detached and not mode)
            elif mode and drafter_up and info.seconds.get("draft_extend"):  # prompts alone: see the module
                policy.observe_goodput(running_before, True, 0, info.seconds["draft_extend"])
