"""Simulate the H200 call-8 REST waves (docs/bench-results/2026-12-02f-h200-call8-rest-8b-useless-head-full.log)
against the real speculation policy, goodput arbiter, drafter attachment and step accounting, on a simulated clock.

A useless head (every draft rejected: a round emits one token a request), the seeded step costs of that run
(plain / round ms by batch bucket), runs of 4 queued steps or rounds (overlapped: a step reads one back and queues
the next where the batch and the mode stay), a catch-up round after plain steps (not metered), prompts prefilled
apart (REST arrivals ARRIVAL_S apart, a step of prompts PREFILL_S + PREFILL_PER_S each), prompts admitted while
detached never draft (the engine's join after a re-attach, DraftLink.join_running, is not simulated), and the waves c1x64 x4, c1x256, c8x256, c64x256, c1x1024, c8x1024, c64x1024 with idle gaps.
Prints each wave's throughput and steps by mode, the detaches and attaches, and the batch-8 meters at each wave's
start. ``python scripts/sim_policy_waves.py [WAVE_INDEX]``: WAVE_INDEX traces every decision of that wave.
With the defaults the c8x1024 wave (index 8) speculated ~86 % of its steps with no detach before the fix
(the detached plain meter at batch 8 frozen at ~1270 tok/s by the c64x256 ramp, speculation measured ~1320).
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_spec_policy import SimClock  # noqa: E402
from tandem.engine.step import StepInfo  # noqa: E402
from tandem.engine.step_accounting import StepAccounting  # noqa: E402
from tandem.speculative.attachment import DrafterAttachment  # noqa: E402
from tandem.speculative.policy import PolicyConfig, RequestSpecState, SpeculationPolicy, cost_bucket  # noqa: E402

PLAIN_MS = {1: 4.49, 2: 4.95, 4: 4.95, 8: 5.06, 16: 5.0, 32: 5.05, 64: 5.38}
ROUND_MS = {1: 5.99, 2: 6.14, 4: 6.20, 8: 6.33, 16: 6.32, 32: 6.70, 64: 9.17}
RUN = 4
HOST_S = 0.2e-3
PREFILL_S = float(os.environ.get("PREFILL_S", "0.03"))
PREFILL_PER_S = float(os.environ.get("PREFILL_PER_S", "0.001"))
ARRIVAL_S = float(os.environ.get("ARRIVAL_S", "0.004"))  # per step: streaming etc.


RUN_ROUND_MS = {**ROUND_MS, 8: float(os.environ.get("ROUND8_MS", "6.0"))}


def cost(n, spec, seeded=False):
    if spec and not seeded:
        return RUN_ROUND_MS[cost_bucket(n)] * 1e-3
    return (ROUND_MS if spec else PLAIN_MS)[cost_bucket(n)] * 1e-3


class Req:
    def __init__(self, left, drafts):
        self.left, self.drafts, self.held, self.state = left, drafts, False, RequestSpecState()


class Sim:
    def __init__(self, trace=False):
        self.clock = SimClock()
        self.policy = SpeculationPolicy(PolicyConfig(), clock=self.clock)
        self.att = DrafterAttachment(clock=self.clock)
        self.acc = StepAccounting(prefill_apart=True)
        self.running, self.waiting = [], []
        self.in_flight = None  # ("spec"|"plain", reqs)
        self.speculating = True
        self.log, self.trace = [], trace
        self.stats = Counter()

    def seed(self):
        for n in PLAIN_MS:
            for _ in range(3):
                for spec in (False, True):
                    self.policy.observe_step(n, spec, RUN, RUN * cost(n, spec, True))
                    self.policy.observe_step(n, spec, 1, cost(n, spec, True))
        self.policy.forget_traffic()
        self.att.reset()

    def prompts_due(self):
        return bool(self.waiting) and not (self.acc.decode_owed_s > 0)

    def decide(self):
        if not self.running:
            self.att.idle()
            self._keep(False)
            return False
        drafting = [r for r in self.running if r.drafts]
        asked = bool(drafting) and self.att.policy_may_decide(len(drafting), len(self.running))
        runs = not self.prompts_due()
        states = [r.state for r in drafting] if asked else []
        g = self.policy.goodput
        before = (g._mode, g._exploring)
        self.speculating = self.policy.decide(len(self.running), states, runs)
        settled = asked and not self.speculating and self.policy.plain_measured_faster(len(self.running))
        self._keep(asked, settled)
        if self.trace:
            print(f"{self.clock.now:8.4f} n={len(self.running)} asked={asked} spec={self.speculating} "
                  f"psince={self.policy.plain_steps_since_spec} mode/expl={before}->{(g._mode, g._exploring)} "
                  f"rates={g.rates(len(self.running))} next={g._next_explore} due={g._due} det={self.att.detached} "
                  f"settled={settled}")
        return self.speculating

    def _keep(self, asked, settled=False):
        can_switch = self.in_flight is None or self.in_flight[0] == "plain"
        change = self.att.after_decision(self.speculating, asked, can_switch, settled)
        if change == "detach":
            for r in self.running + self.waiting:
                r.drafts, r.held = False, False
        if change:
            n = len(self.running)
            self.log.append((round(self.clock.now, 3), change, n, self.policy.explain(n) if n else ""))

    def step(self):
        started = self.clock.now
        self.acc.step_starts(started, self.policy)
        before = len(self.running)
        spec = self.decide()
        tokens, took = 0, HOST_S
        info = None
        if self.in_flight is not None:
            kind, reqs = self.in_flight
            self.in_flight = None
            n = len(reqs)
            is_spec = kind == "spec"
            for r in reqs:
                made = RUN  # tau 1: one token a round / a step
                if is_spec:
                    for _ in range(RUN):
                        self.policy.observe_round(r.state, 1)
                r.left -= made
                tokens += made
                if not is_spec:
                    r.held = r.drafts
            took += RUN * cost(n, is_spec)
            info = StepInfo(0, n, {}, steps=RUN, speculative=is_spec, timed=True)
            finished = any(r.left <= 0 for r in reqs)
            self.running = [r for r in self.running if r.left > 0]
            # queue the next run when the batch is unchanged and the mode is the same
            if not finished and not self.prompts_due() and (spec == is_spec) and not self.acc.after_prompts:
                if not is_spec or all(r.drafts and not r.held for r in self.running):
                    self.in_flight = (kind, list(self.running))
            self.stats["spec_steps" if is_spec else "plain_steps"] += 1
        elif self.waiting and (not self.running or self.prompts_due()):
            admitted, self.waiting = self.waiting, []
            for r in admitted:
                r.drafts = not self.att.detached
                r.held = r.drafts and not spec
            self.running += admitted
            took += PREFILL_S + PREFILL_PER_S * len(admitted)
            info = StepInfo(len(admitted), 0, {}, prefill_tokens=64 * len(admitted))
            tokens = len(admitted)
        elif self.running:
            n = len(self.running)
            drafting = [r for r in self.running if r.drafts]
            is_spec = spec and bool(drafting)
            single = self.prompts_due() or self.acc.after_prompts
            resumed = is_spec and any(r.held for r in drafting)
            can_run = not single and (not is_spec or (len(drafting) == n and not resumed))
            if can_run:
                self.in_flight = ("spec" if is_spec else "plain", list(self.running))
                return self.step_rest(started, before, spec)
            for r in self.running:
                if is_spec:
                    if r in drafting:
                        self.policy.observe_round(r.state, 1)
                    r.held = False
                else:
                    r.held = r.drafts
                r.left -= 1
                tokens += 1
            took += cost(n, is_spec) + (2e-3 if resumed else 0)
            info = StepInfo(0, n, {}, speculative=is_spec, timed=not resumed)
            self.running = [r for r in self.running if r.left > 0]
            self.stats["spec_steps" if is_spec else "plain_steps"] += 1
        else:
            return
        self.clock.now += took
        self.acc.step_ended(self.policy, info, started, self.clock.now, before, len(self.running), spec, object(),
                            True, tokens, detached=self.att.detached)

    def step_rest(self, started, before, spec):
        # the step queued a run and reads it back at once (it stays in flight for the read-back below)
        kind, reqs = self.in_flight
        self.in_flight = None
        if True:  # queued this step, read back this step, the following queued where the batch stays
            tokens, took = 0, HOST_S
            n = len(reqs)
            is_spec = kind == "spec"
            for r in reqs:
                if is_spec:
                    for _ in range(RUN):
                        self.policy.observe_round(r.state, 1)
                else:
                    r.held = r.drafts
                r.left -= RUN
                tokens += RUN
            took += RUN * cost(n, is_spec)
            info = StepInfo(0, n, {}, steps=RUN, speculative=is_spec, timed=True)
            finished = any(r.left <= 0 for r in reqs)
            self.running = [r for r in self.running if r.left > 0]
            if not finished and not self.prompts_due() and not self.acc.after_prompts:
                self.in_flight = (kind, list(self.running))
            self.stats["spec_steps" if is_spec else "plain_steps"] += 1
        self.clock.now += took
        self.acc.step_ended(self.policy, info, started, self.clock.now, before, len(self.running), spec, object(),
                            True, tokens, detached=self.att.detached)

    def wave(self, conc, tokens, gap=0.2):
        self.clock.now += gap
        self.step()  # idle step
        t0 = self.clock.now
        self.stats = Counter()
        g = self.policy.goodput
        print("   meters@8:", {k[1]: (round(m.rate), round(m.seconds, 3), round(t0 - m.last, 2)) for k, m in g._meters.items() if k[0] == 8},
              "mode", g._mode, g._exploring, "best", g._best, "next", {b: round(t - t0, 2) for b, t in g._next_explore.items()}, "due", g._due)
        arrivals = [(t0 + i * ARRIVAL_S, Req(tokens, True)) for i in range(conc)]
        while self.running or self.waiting or arrivals:
            while arrivals and arrivals[0][0] <= self.clock.now:
                self.waiting.append(arrivals.pop(0)[1])
            if not self.running and not self.waiting:
                self.clock.now = arrivals[0][0]
                continue
            self.step()
        dt = self.clock.now - t0
        print(f"wave c{conc}x{tokens}: {dt:.3f} s, {conc * tokens / dt:.0f} tok/s, {dict(self.stats)}")


def main(trace_wave=None):
    sim = Sim()
    sim.seed()
    waves = [(1, 64)] * 4 + [(1, 256), (8, 256), (64, 256), (1, 1024), (8, 1024), (64, 1024)]
    for i, w in enumerate(waves):
        sim.trace = trace_wave == i
        n0 = len(sim.log)
        sim.wave(*w)
        for entry in sim.log[n0:]:
            print("   ", entry)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else None)
