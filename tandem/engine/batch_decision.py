"""The speculation decision for the running batch, once a step (``LLMEngine.step``, before any page is reserved): the
policy's verdict (tandem.speculative.policy) for the batch actually running, the drafter detached from a batch kept
plain or attached again (tandem.speculative.attachment), and the step's verify width (1: a plain step). Requests that
cannot draft in a speculating step are verified as filler rows of that width (``DraftTree.padded``), so the batch keeps
one width, one graphed forward."""

from __future__ import annotations

import logging

from tandem.engine.decode_ahead import DecodeRun
from tandem.speculative.policy import PASSING_PLAIN

log = logging.getLogger("tandem.engine")


class BatchDecision:
    def __init__(self) -> None:
        self.detached_decided: dict[int, float] = {}  # batch size -> until when a detached decision at it stands

    def __call__(self, engine) -> int:
        """The decision for ``engine``'s running batch (an LLMEngine); → the step's verify width (1: a plain step)."""
        if engine.proposer is None:  # target-only: every step plain, as the decision below concludes (~8 µs a step)
            engine.speculating, engine.undrafted, engine.plain_reason = False, False, "drafter down"
            return 1
        running = engine.scheduler.running
        if not running:  # (the latest decision stands for the prompts about to be admitted)
            engine.attachment.idle()
            self.detached_decided.clear()
            return 1
        if self.detached_decided:  # a detached decision of a moment ago at this batch size stands (see below)
            if not engine.attachment.detached:
                self.detached_decided.clear()
            elif engine.attachment.clock() < self.detached_decided.get(len(running), 0.0):
                return 1
        drafting = [req for req in running if engine.can_draft(req)] if engine.drafts.up() else []
        speculative = sum(req.spec is not None for req in running)  # (requests with speculation off never draft)
        engine.undrafted = speculative > len(drafting)
        if not drafting and engine.attachment.detached:  # a detached period: plain, and only whether it ends is decided
            # (what the whole decision below concludes with nothing drafting, in fewer calls)
            engine.speculating = engine.policy.decide(len(running), [])  # (False: the policy's own reason and view)
            engine.plain_reason = "no drafts" if engine.drafts.up() else "drafter down"
            self._keep_attachment(engine, False, spec_favoured=engine.policy.speculation_favoured(len(running)))
            if engine.attachment.detached:  # asked again at this batch size after detached_decided_every_s; kept per
                # size, as under arrivals the batch moves between a few sizes every few steps
                self.detached_decided[len(running)] = (engine.attachment.clock()
                                                       + engine.attachment.cfg.detached_decided_every_s)
            return 1
        asked = bool(drafting) and engine.attachment.policy_may_decide(len(drafting), speculative)
        runs = (engine.spec_rounds > 1 or engine.decode_steps > 1) and not engine.prompts_due()
        states = [req.spec_state for req in drafting] if asked else []
        engine.speculating = engine.policy.decide(len(running), states, runs)
        # plain, and measured to be faster: the drafter detaches at once (tandem.speculative.attachment); or a
        # probe: speculation ahead of attached plain steps only, the step plain and the drafter detached briefly
        settled = asked and not engine.speculating and engine.policy.plain_measured_faster(len(running))
        # detached, or attached early by a favoured bucket: whether this bucket favours speculation (attach / stay)
        favoured = ((engine.attachment.detached or engine.attachment.attached_early)
                    and engine.policy.speculation_favoured(len(running)))
        # (plain: it detaches again now)
        back = self._can_switch(engine) and engine.attachment.returns_detached(favoured)
        probe = (not back and asked and engine.speculating and self._can_switch(engine)
                 and engine.policy.probe_detached(len(running), engine.proposer.ships_features))
        engine.speculating = engine.speculating and not probe and not back
        engine.plain_reason = (None if engine.speculating else "probe" if probe
                               else "drafter down" if not engine.drafts.up()
                               else "no drafts" if not drafting else "detached" if not asked or back
                               else engine.policy.plain_reason)
        if engine.speculating and engine.default_spec is not None:
            engine.chain.use(engine.policy.chain_spec(len(running), engine.default_spec), engine.default_spec,
                             lambda: running + list(engine.scheduler.waiting), now=self._can_switch(engine))
        loss = engine.policy.measured_loss(len(running)) if settled else 0.0
        self._keep_attachment(engine, asked, settled, loss, probe, lambda: engine.policy.measured_lead(len(running)),
                              favoured, back)
        return max((req.spec.num_draft_tokens for req in drafting), default=1) if engine.speculating else 1

    @staticmethod
    def _can_switch(engine) -> bool:
        """No run of rounds in flight (its requests' draft state is in use)."""
        return engine.run_in_flight is None or isinstance(engine.run_in_flight, DecodeRun)

    @staticmethod
    def _keep_attachment(engine, asked: bool, plain_measured_faster: bool = False, loss: float = 0.0,
                         probe: bool = False, spec_lead=lambda: None, spec_favoured: bool = False,
                         back: bool = False) -> None:
        """Detach the drafter from a batch the policy keeps plain (or for a probe), or attach it again
        (tandem.speculative.attachment); never under a run of rounds in flight."""
        change = engine.attachment.after_decision(engine.speculating, asked, BatchDecision._can_switch(engine),
                                                  plain_measured_faster, loss, probe, spec_lead, spec_favoured,
                                                  passing=engine.plain_reason in PASSING_PLAIN, back=back)
        if change == "detach":
            engine.drafts.detach(engine.scheduler.running + list(engine.scheduler.waiting))
            log.info("%s at batch %d: the drafter is detached (it is healthy; plain steps run target-only); %s",
                     "plain steps measured without the drafter" if probe
                     else "back to the detached period a favoured batch cut short" if back
                     else "speculation off for a while",
                     len(engine.scheduler.running), engine.policy.explain(len(engine.scheduler.running)))
        elif change == "attach":
            engine.drafts.joins_due = True
            log.info("the drafter is attached again: prompts admitted from now on can speculate")
