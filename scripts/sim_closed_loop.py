"""A closed loop of 64 clients against the real speculation policy, goodput arbiter, drafter attachment and step
accounting on a simulated clock (adapted from scripts/sim_policy_waves.py): a chain of 3 drafts accepted at random
for a mean of TAU tokens a round, requests of 120 new tokens replaced after a turnaround, requests admitted while
detached drafting only once they join (at a lower τ), BatchDecision (tandem/engine/batch_decision.py) as the engine runs
them (probes, joins, a batch attached early going back). Prints tokens/s, detaches and attaches, and the share of
speculative steps by bucket.

    python scripts/sim_closed_loop.py VARIANT TAU [COSTS] [SEED]

VARIANT: ``new`` (the code as it is), ``old`` (a bucket favours speculation only by its verdict, not by the traffic's
τ), ``always``, ``never``. COSTS: ``demo`` (step costs like the demo pair's, speculation winning at every bucket) or
``heavy`` (rounds far dearer at 32 and 64: plain wins at the full bucket). Environment: PHASES=FULL_S,LOW_S,LOW_CLIENTS
swings the load (e.g. ``1.0,0.6,6``: a second of 64 clients, 0.6 s of 6), TURN, DURATION, HEAVY64, HOST_S, ATT_TAX,
REASONS=1 and LOG=N for more output. Results are a model's, not a measurement: costs, host time and joins are guesses.
"""
from __future__ import annotations

import heapq
import math
import os
import random
import sys
from collections import Counter, defaultdict

sys.path.insert(0, "/work/main/tests")
sys.path.insert(0, "/work/main")
from policy_sim import SimClock  # noqa: E402
from tandem.engine.step import StepInfo  # noqa: E402
from tandem.engine.step_accounting import StepAccounting  # noqa: E402
from tandem.speculative.attachment import DrafterAttachment  # noqa: E402
from tandem.speculative.policy import (PASSING_PLAIN, PolicyConfig, RequestSpecState,  # noqa: E402
                                       SpeculationPolicy, cost_bucket)

BUCKETS = [1, 2, 4, 8, 16, 32, 64]
PLAIN_MS = dict(zip(BUCKETS, [0.25, 0.27, 0.30, 0.38, 0.55, 0.85, 1.40]))
ROUND_MS = dict(zip(BUCKETS, [0.50, 0.52, 0.56, 0.66, 0.85, 1.20, 1.80]))
# "heavy": speculation loses at the full bucket (the change's motivating case): rounds at 32/64 far dearer
ROUND_HEAVY_MS = {**ROUND_MS, 32: 2.4, 64: float(os.environ.get("HEAVY64", "6.0"))}
RUN = 4  # steps / rounds per queued run
DRAFTS = 3
WIDTH = DRAFTS + 1
HOST_S = float(os.environ.get("HOST_S", "0.1e-3"))  # host per engine step (a run or a single step)
PREFILL_S, PREFILL_PER_S = 0.4e-3, 0.02e-3  # a step of prompts alone
PROMPT_TOKENS = 128
EXTEND_PER_TOKEN_S = 0.3e-6  # drafter extension of a prompt token (only while attached and speculating)
RESUME_S = 0.2e-3  # a catch-up round's extra
ATT_TAX = float(os.environ.get("ATT_TAX", "0.05"))  # attached plain steps cost this much more than detached
CLIENTS, NEW_TOKENS = 64, 120
TURN = tuple(float(x) for x in os.environ.get("TURN", "0.020,0.060").split(","))
DURATION = float(os.environ.get("DURATION", "20"))
JOIN_MIN_LEFT = 32
CLIENT_S = float(os.environ.get('CLIENT_S', '0'))
PHASES = tuple(float(x) for x in os.environ['PHASES'].split(',')) if os.environ.get('PHASES') else None
BARRIER = bool(int(os.environ.get('BARRIER', '0')))


def interp(table, n):
    lo = max(b for b in BUCKETS if b <= n)
    hi = min([b for b in BUCKETS if b >= n] or [64])
    if lo == hi:
        return table[lo]
    f = (math.log2(n) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return table[lo] + f * (table[hi] - table[lo])


def alpha_for(tau):
    """Per-draft acceptance giving mean tokens a round tau on a chain of DRAFTS (1 + a + a^2 + a^3)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a ** i for i in range(DRAFTS + 1)) < tau:
            lo = a
        else:
            hi = a
    return lo


class Req:
    __slots__ = ("left", "drafts", "held", "state", "alpha", "client")

    def __init__(self, client, alpha):
        self.left, self.drafts, self.held, self.state = NEW_TOKENS, False, False, RequestSpecState()
        self.alpha, self.client = alpha, client


class Sim:
    def __init__(self, variant, tau, costs="demo", seed=1, tau_join=None):
        self.rng = random.Random(seed)
        self.variant = variant
        self.round_ms = ROUND_HEAVY_MS if costs == "heavy" else ROUND_MS
        self.alpha = alpha_for(tau)
        self.alpha_join = alpha_for(tau_join if tau_join is not None else min(2.0, tau - 0.1 if tau < 2.1 else 2.0))
        self.clock = SimClock()
        cfg = PolicyConfig(enabled=variant != "always")
        self.policy = SpeculationPolicy(cfg, clock=self.clock)
        self.att = DrafterAttachment(clock=self.clock)
        self.acc = StepAccounting(prefill_apart=True)
        self.running, self.waiting = [], []
        self.arrivals = []  # heap (time, client)
        self.parked = []
        self.client_free = 0.0
        self.in_flight = None
        self.speculating = True
        self.joins_due = False
        self.log = []
        self.tokens = 0
        self.steps_by = defaultdict(Counter)  # bucket -> Counter(spec=, plain=) (decode steps, runs counted x RUN)
        self.time_by = Counter()  # bucket -> seconds of decode steps
        self.spec_time = Counter()
        self.undrafted_spec_steps = 0
        self.favoured_why = Counter()
        self.reasons = defaultdict(Counter)

    # -- costs ---------------------------------------------------------------------------------
    def cost(self, n, spec, attached=True):
        if spec:
            return interp(self.round_ms, n) * 1e-3
        return interp(PLAIN_MS, n) * 1e-3 * (1 + ATT_TAX if attached else 1)

    def seed(self):
        for n in BUCKETS:
            for _ in range(3):
                self.policy.observe_step(n, True, RUN, RUN * self.cost(n, True) + HOST_S, width=WIDTH, seeded=True)
                self.policy.observe_step(n, True, 1, self.cost(n, True) + HOST_S, width=WIDTH, seeded=True)
                for det in (False, True):
                    self.policy.observe_step(n, False, RUN, RUN * self.cost(n, False, not det) + HOST_S,
                                             detached=det, seeded=True)
                    self.policy.observe_step(n, False, 1, self.cost(n, False, not det) + HOST_S, detached=det,
                                             seeded=True)
        self.policy.forget_traffic()
        self.att.reset()
        if self.variant == "never":
            self.att.hold_detached()

    def round_tokens(self, r):
        t = 1
        while t <= DRAFTS and self.rng.random() < r.alpha:
            t += 1
        return t

    def prompts_due(self):
        return bool(self.waiting) and not (self.acc.decode_owed_s > 0)

    # -- the engine's BatchDecision -------------------------------------------------
    def decide(self):
        n = len(self.running)
        drafting = [r for r in self.running if r.drafts]
        self.undrafted = n > len(drafting)
        asked = bool(drafting) and self.att.policy_may_decide(len(drafting), n)
        runs = not self.prompts_due()
        states = [r.state for r in drafting] if asked else []
        spec = self.policy.decide(n, states, runs)
        settled = asked and not spec and self.policy.plain_measured_faster(n)
        can_switch = self.in_flight is None or self.in_flight[0] == "plain"
        favoured = (self.att.detached or self.att.attached_early) and self.policy.speculation_favoured(n)
        back = can_switch and self.att.returns_detached(favoured)
        probe = not back and asked and spec and can_switch and self.policy.probe_detached(n, True)
        spec = spec and not probe and not back
        self.speculating = spec
        reason = (None if spec else "probe" if probe else "no drafts" if not drafting else "detached" if not asked or back
                  else self.policy.plain_reason)
        self.reasons[cost_bucket(n)][reason or "spec"] += 1
        if favoured and self.att.detached:
            g = self.policy.goodput
            self.favoured_why["verdict" if g.has_verdict(n) else "tau-rule"] += 1
        change = self.att.after_decision(spec, asked, can_switch, settled,
                                         self.policy.measured_loss(n) if settled else 0.0, probe,
                                         lambda: self.policy.measured_lead(n), favoured,
                                         passing=reason in PASSING_PLAIN, back=back)
        if change == "detach":
            for r in self.running + self.waiting:
                r.drafts, r.held = False, False
        elif change == "attach":
            self.joins_due = True
        if change:
            g = self.policy.goodput
            why = ""
            if change == "attach":
                why = ("favoured:" + ("verdict" if g.has_verdict(n) else "tau-rule")) if favoured else "period-end"
            elif probe:
                why = "probe"
            else:
                why = "settled" if settled else "plain-clock"
            self.log.append((self.clock.now, change, n, why, self.policy.explain(n)))
        return spec

    def join(self):
        if self.joins_due and self.in_flight is None:
            self.joins_due = False
            if self.att.detached:
                return
            for r in self.running:
                if not r.drafts and r.left >= JOIN_MIN_LEFT:
                    r.drafts, r.held, r.alpha = True, True, self.alpha_join

    # -- a step ----------------------------------------------------------------------------------
    def emit(self, r, k):
        k = min(k, r.left)
        r.left -= k
        self.tokens += k

    def finish_done(self):
        keep = []
        for r in self.running:
            if r.left > 0:
                keep.append(r)
            else:
                self.policy.observe_finished(PROMPT_TOKENS, NEW_TOKENS)
                if BARRIER:  # the client waits for its wave (all 64) to end
                    self.parked.append(r.client)
                    if len(self.parked) == CLIENTS:
                        for c in self.parked:
                            heapq.heappush(self.arrivals, (self.clock.now + self.rng.uniform(*TURN), c))
                        self.parked = []
                elif CLIENT_S:  # one client thread handles finished requests in turn, CLIENT_S each
                    self.client_free = max(self.client_free, self.clock.now) + CLIENT_S
                    heapq.heappush(self.arrivals, (self.client_free + self.rng.uniform(*TURN), r.client))
                else:
                    t = self.clock.now + self.rng.uniform(*TURN)
                    if PHASES and r.client >= PHASES[2]:  # a low phase: only PHASES[2] clients go on
                        period = PHASES[0] + PHASES[1]
                        k, into = divmod(t - self.t0, period)
                        if into >= PHASES[0]:
                            t = self.t0 + (k + 1) * period + self.rng.uniform(0, 0.01)
                    heapq.heappush(self.arrivals, (t, r.client))
        self.running = keep

    def run_tokens(self, reqs, is_spec, steps):
        for r in reqs:
            if r.left <= 0:
                continue
            if is_spec and r.drafts:
                made = 0
                for _ in range(steps):
                    t = self.round_tokens(r)
                    self.policy.observe_round(r.state, t)
                    made += t
                r.held = False
            else:
                made = steps
                if not is_spec:
                    r.held = r.drafts
            self.emit(r, made)

    def step(self):
        started = self.clock.now
        self.acc.step_starts(started, self.policy)
        self.join()
        before = len(self.running)
        spec = self.decide() if self.running else self._idle()
        took, info, tokens0 = HOST_S, None, self.tokens
        detached = self.att.detached
        undrafted = False
        if self.in_flight is not None or (self.running and not (self.waiting and self.prompts_due())):
            n = len(self.running)
            drafting = [r for r in self.running if r.drafts]
            if self.in_flight is not None:
                kind, reqs = self.in_flight
                self.in_flight = None
                is_spec, steps, resumed = kind == "spec", RUN, False
            else:
                reqs = list(self.running)
                is_spec = spec and bool(drafting)
                resumed = is_spec and any(r.held for r in drafting)
                single = self.prompts_due() or self.acc.after_prompts
                can_run = not single and (not is_spec or (len(drafting) == n and not resumed))
                steps = RUN if can_run else 1
            undrafted = is_spec and any(not r.drafts for r in reqs)
            if undrafted:
                self.undrafted_spec_steps += 1
            self.run_tokens(reqs, is_spec, steps)
            took += steps * self.cost(n, is_spec, not detached) + (RESUME_S if resumed else 0)
            b = cost_bucket(n)
            self.steps_by[b]["spec" if is_spec else "plain"] += steps
            self.time_by[b] += took
            if is_spec:
                self.spec_time[b] += took
            info = StepInfo(0, n, {}, steps=steps, speculative=is_spec, timed=not resumed,
                            width=WIDTH if is_spec else 1)
            finished = any(r.left <= 0 for r in reqs)
            self.finish_done()
            if (steps == RUN and not finished and not self.prompts_due() and spec == is_spec
                    and not self.acc.after_prompts and not self.joins_due):
                if not is_spec or all(r.drafts and not r.held for r in self.running):
                    self.in_flight = ("spec" if is_spec else "plain", list(self.running))
        elif self.waiting:
            admitted, self.waiting = self.waiting, []
            extend = spec and not detached and bool(self.running or True)
            for r in admitted:
                r.drafts = not detached
                r.held = r.drafts and not spec
                self.emit(r, 1)
            self.running += admitted
            took += PREFILL_S + PREFILL_PER_S * len(admitted)
            spans = {}
            if extend:
                ext = EXTEND_PER_TOKEN_S * PROMPT_TOKENS * len(admitted)
                took += ext
                spans = {"draft_extend": (0, int(ext * 1e9))}
            info = StepInfo(len(admitted), 0, spans, prefill_tokens=PROMPT_TOKENS * len(admitted))
        else:
            return False
        self.clock.now += took
        self.acc.step_ended(self.policy, info, started, self.clock.now, before, len(self.running), spec, object(),
                            True, self.tokens - tokens0, detached=detached, undrafted=undrafted)
        return True

    def _idle(self):
        self.att.idle()
        return self.speculating

    def run(self):
        self.seed()
        t0 = self.t0 = self.clock.now
        for c in range(CLIENTS):
            heapq.heappush(self.arrivals, (t0 + self.rng.uniform(0, 0.01), c))
        self.batch_time = Counter()
        self.series = []
        end = t0 + DURATION
        while self.clock.now < end:
            while self.arrivals and self.arrivals[0][0] <= self.clock.now:
                _, c = heapq.heappop(self.arrivals)
                self.waiting.append(Req(c, self.alpha))
            if not self.running and not self.waiting:
                self.clock.now = self.arrivals[0][0]
                continue
            n0, t_before = len(self.running), self.clock.now
            self.step()
            self.batch_time[cost_bucket(max(1, n0))] += self.clock.now - t_before
            self.series.append((t_before, n0))
        self.t0, self.end = t0, self.clock.now


def report(sim, label):
    dur = sim.end - sim.t0
    det = [e for e in sim.log if e[1] == "detach"]
    att = [e for e in sim.log if e[1] == "attach"]
    share = {b: f"{100 * c['spec'] / max(1, c['spec'] + c['plain']):.0f}%" for b, c in sorted(sim.steps_by.items())}
    tshare = {b: f"{100 * t / dur:.0f}%" for b, t in sorted(sim.batch_time.items())}
    print(f"== {label}: {sim.tokens / dur:,.0f} tok/s over {dur:.1f} s; detaches {len(det)} attaches {len(att)} "
          f"({(len(det) + len(att)) / 2 / dur:.2f} cycles/s)")
    print("   spec share of decode steps by bucket:", share)
    print("   time by bucket:", tshare, " undrafted spec steps:", sim.undrafted_spec_steps)
    print("   detach reasons:", Counter(e[3] for e in det), " attach reasons:", Counter(e[3] for e in att))
    print("   detach at buckets:", Counter(cost_bucket(max(1, e[2])) for e in det),
          " attach at buckets:", Counter(cost_bucket(max(1, e[2])) for e in att))
    # detached / attached spans
    spans, last, state = [], sim.t0, "attached"
    for e in sim.log:
        spans.append((state, e[0] - last))
        last, state = e[0], "detached" if e[1] == "detach" else "attached"
    spans.append((state, sim.end - last))
    dspans = [s for k, s in spans if k == "detached"]
    aspans = [s for k, s in spans[1:] if k == "attached"]
    if dspans:
        print(f"   detached: {sum(dspans):.2f} s total, spans min/median/max "
              f"{min(dspans):.3f}/{sorted(dspans)[len(dspans) // 2]:.3f}/{max(dspans):.3f} s")
    if aspans:
        print(f"   attached spans after a re-attach: min/median/max "
              f"{min(aspans):.3f}/{sorted(aspans)[len(aspans) // 2]:.3f}/{max(aspans):.3f} s")
    # batch per 50 ms window: min and max
    win = defaultdict(list)
    for t, n in sim.series:
        win[int((t - sim.t0) / 0.05)].append(n)
    mins = sorted(min(v) for v in win.values()); maxs = sorted(max(v) for v in win.values())
    q = lambda xs, p: xs[int(p * (len(xs) - 1))]
    print(f"   batch per 50ms window: min p10/p50/p90 {q(mins,.1)}/{q(mins,.5)}/{q(mins,.9)}, "
          f"max p10/p50/p90 {q(maxs,.1)}/{q(maxs,.5)}/{q(maxs,.9)}; windows with a batch <=12: "
          f"{sum(m <= 12 for m in mins)}/{len(mins)}")
    if os.environ.get("REASONS"):
        for b, c in sorted(sim.reasons.items()):
            print(f"   decisions at {b}: {dict(c)}")
    print("   spec seconds by bucket:", {b: round(t, 2) for b, t in sorted(sim.spec_time.items())})
    print("   favoured asks (detached):", dict(sim.favoured_why))
    if os.environ.get("LOG"):
        for e in sim.log[: int(os.environ["LOG"])]:
            print(f"   {e[0] - sim.t0:7.3f} {e[1]:6s} n={e[2]:2d} {e[3]:18s} {e[4]}")


if __name__ == "__main__":
    variant, tau = sys.argv[1], float(sys.argv[2])
    costs = sys.argv[3] if len(sys.argv) > 3 else "demo"
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    if variant == "old":
        SpeculationPolicy.speculation_favoured = (
            lambda self, b: self.goodput is not None and self.goodput.favours_speculation(b))
    sim = Sim(variant, tau, costs, seed)
    sim.run()
    report(sim, f"{variant} tau={tau} costs={costs} seed={seed}")
