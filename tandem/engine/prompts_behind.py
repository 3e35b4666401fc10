"""Prompts queued behind the run in flight: an arrival's prefill goes on the device before that run is read back.

With prompts kept apart from decoding (graphs), a prompt that arrives while a run of decode steps is in flight used to
wait for the step that reads the run back (it queues nothing after it: the batch is about to change) and then for a
step of its own — its scheduling, staging and launch done on the host while the device sat idle, the engine loop's
round trip in between. At concurrency 8 on the demo target such steps were a fifth of a closed loop's time
(bench/profile_arrivals.py). Here the step that reads the run back admits the prompts first and queues their forward
behind the run (their pages are their own; the run's requests keep theirs), reads the run back and commits it while the
device prefills, then samples and commits the prompts' first tokens: the device goes from the run to the prompts
without waiting on the host, and the step counts as a step of prompts alone (decoding is owed after it, as after one),
timed from the run's read-back (StepInfo.timed_from: the run's device time is not the prompts'). The prompts' forward is
waited for inside the watchdog before their acceptance, a chunk that samples nothing included.

A one-token chunk (a prompt found cached but for its last token) replays the decode family, whose static inputs the run
in flight was queued from: safe because no run goes on from them after it (none is queued behind the run read back
here, and the next run is staged afresh: the batch changed).

Only where such a step would be a plain target forward: one rank, nothing captured for a drafter (none, or detached)
or for traffic, the batch decoding plainly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.engine.step import StepTimer

if TYPE_CHECKING:
    from tandem.engine.step import LaunchedVerify


def launch_prompts_behind(engine, run_steps: int, timer: StepTimer) -> "LaunchedVerify | None":
    """Admit the prompts due and queue their forward behind the run of ``run_steps`` decode steps in flight (nothing
    queued after it) → what ``engine.verify_read`` finishes once that run is committed, or None (nothing due, or not
    this path)."""
    if (not engine.prefill_apart or not engine.overlap_runs or engine.speculating or engine.drafts.keeping()
            or engine.traffic is not None or engine.cfg.tp_size > 1 or not engine.prompts_due()):
        return None
    cap = engine.accounting.pace.chunk_cap(engine.decode_steps, False, engine.executor.prefill_graph_width)
    # the running requests' pages held back from the prompts: the run's and their next step's
    sched = engine.scheduler.schedule(lambda req: run_steps + 1, decode=False, chunk_cap=cap)
    if not sched.prefill:
        return None
    return engine.verify_launch(sched, 1, timer, sync=False)
