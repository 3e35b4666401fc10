"""bench/stack_log.py reads the verifier's own stats lines (verifier/stats_line.py writes them here) and the engine's
detach / attach log lines: a load's row reports how much the engine speculated, decoded plainly attached or detached."""

from __future__ import annotations

from pathlib import Path

from bench_modules import import_bench
from verifier.stats_line import StatsLine

(stack_log,) = import_bench("stack_log")


def _window(spec_steps: int, plain_steps: int, detached: bool = False, drafts: int = 3, run: int = 1,
            plain_for: str = "exploring", switches: int = 0, overlapped: int = 0) -> str:
    cpu, thread = [0.0], [0.0]  # the process's CPU a step 0.5 ms, the engine thread's 0.3 of it
    stats = StatsLine(0.5, speculative=True, cpu_clock=lambda: cpu[0], thread_clock=lambda: thread[0])
    for k in range(spec_steps + plain_steps):
        cpu[0] += 5e-4
        thread[0] += 3e-4
        spec = k < spec_steps
        stats.step(1.0 + 0.001 * k, 0.001, 3 if spec else 1, int(spec), 2 if spec else 0, speculative=spec,
                   drafted=drafts if spec else 0, run=run if spec else 1, plain_reason=None if spec else plain_for,
                   queued_ahead=k < overlapped)
    stats.chain_switched(switches)
    return "2026-12-03 18:04:00,000 INFO verifier.stats: " + stats.line(8, 0, 0.01, detached=detached) + "\n"


def test_a_load_reports_what_the_engine_did_in_its_stats_windows():
    tag = "in-process (test)"
    stack_log.note(tag, _window(1, 0))  # before the load: not counted
    before = stack_log.EVENTS[tag].copy()
    for line in (_window(3, 1, run=4, switches=2, overlapped=2), _window(1, 1, drafts=1, plain_for="timing"),
                 # 75 % and 50 % of steps speculative; chains of 3, in runs of 4 (2 of 3 overlapped), then 1 alone
                 "... INFO tandem.engine: speculation off for a while at batch 8: the drafter is detached (plain ...)\n",
                 _window(0, 4, detached=True), _window(0, 4, detached=True),
                 "... INFO tandem.engine: the drafter is attached again: prompts admitted from now on can speculate\n",
                 "... INFO tandem.engine: 3 running request(s) without draft state join the drafter (their entries ...)\n",
                 "... WARNING tandem.kernels: a Triton kernel was compiled while serving (54 ms, ...): k[...](...)\n",
                 _window(0, 4)):
        stack_log.note(tag, line)
    got = stack_log.since(tag, before)
    assert got == {"detaches": 1, "attaches": 1, "joined": 3, "windows": 5, "spec_step_share": 0.25, "detached_share": 0.4,
                   "attached_plain_share": 0.2, "drafts_per_round": 2.0, "rounds_per_step": 2.5, "overlapped_share": 0.67,
                   "plain_steps_for": {"exploring": 1, "timing": 1}, "chain_switches": 2, "kernels_compiled": 1,
                   "engine_thread_share": 0.6}


def test_the_engine_still_logs_the_phrases_the_bench_counts():
    engine = Path(__file__).resolve().parents[1] / "tandem" / "engine"
    decision = (engine / "batch_decision.py").read_text()
    assert "the drafter is detached" in decision and "the drafter is attached again" in decision
    assert "running request(s) without draft state join the drafter" in (engine / "llm_engine.py").read_text()
    watch = (Path(__file__).resolve().parents[1] / "tandem" / "kernels" / "compile_watch.py").read_text()
    assert "compiled while serving" in watch
