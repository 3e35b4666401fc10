"""The REST benchmarks' service processes, their output tagged by stack and read as it goes: several stacks log into
one file, and an engine's decisions must say whose they are. From each verifier's lines this keeps what a load's
row reports beside its rate: detaches and attaches of the drafter, and per stats window (--log-stats-interval)
whether the engine speculated (its share of steps), decoded plainly with the drafter attached, or detached; and
kernels compiled while serving."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections import Counter, defaultdict

from cpu_pins import as_role

_JOINED = re.compile(r"(\d+) running request\(s\) without draft state join the drafter")
_SPEC_ON = re.compile(r"spec on \((\d+)% of steps(?:, ([\d.]+) drafts a round)?(?:, ([\d.]+) rounds a step)?"
                      r"(?:, (\d+)% overlapped)?(?:; plain for: ([^;)]*))?(?:; (\d+) chain switches)?\)")
_HOST = re.compile(r"host ([\d.]+) CPUs \(the engine thread ([\d.]+)\)")
EVENTS: dict[str, Counter] = defaultdict(Counter)  # tag -> counts of what its lines said


def tagged(args: list[str], tag: str, role: str | None = None, **kwargs) -> subprocess.Popen:
    """A service process whose output lines go to this process's stderr behind ``[tag]``, noted (``note``); on
    ``role``'s CPUs where the bench pins them (bench/cpu_pins.py)."""
    with as_role(role):
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, **kwargs)

    def relay() -> None:
        for line in proc.stdout:
            sys.stderr.write(f"[{tag}] {line}")
            note(tag, line)

    threading.Thread(target=relay, daemon=True).start()
    return proc


def note(tag: str, line: str) -> None:
    counts = EVENTS[tag]
    if "compiled while serving" in line:  # (tandem.kernels.compile_watch: a step waited for a kernel's compilation)
        counts["kernels_compiled"] += 1
    elif "the drafter is detached" in line:
        counts["detaches"] += 1
    elif "the drafter is attached again" in line:
        counts["attaches"] += 1
    elif (joined := _JOINED.search(line)) is not None:  # (tandem.engine.llm_engine: requests that joined the drafter)
        counts["joined"] += int(joined.group(1))
    elif "Decode batch:" in line:
        counts["windows"] += 1
        if (host := _HOST.search(line)) is not None:  # (Counter keeps ints: hundredths of a CPU)
            counts["host_cpu_hundredths"] += round(100 * float(host.group(1)))
            counts["engine_thread_hundredths"] += round(100 * float(host.group(2)))
        spec = _SPEC_ON.search(line)
        if spec:
            counts["spec_percent_sum"] += int(spec.group(1))
            counts["spec_windows"] += 1
            if spec.group(2):  # (Counter keeps ints: tenths of a draft)
                counts["drafts_tenths_sum"] += round(10 * float(spec.group(2)))
                counts["drafted_windows"] += 1
            counts["run_tenths_sum"] += round(10 * float(spec.group(3) or 1))  # (rounds a speculative step)
            if spec.group(4):
                counts["overlapped_percent_sum"] += int(spec.group(4))
                counts["run_windows"] += 1
            for part in (spec.group(5) or "").split(", "):
                if part:
                    why, n = part.rsplit(" ", 1)
                    counts[f"plain for {why}"] += int(n)
            counts["chain_switches"] += int(spec.group(6) or 0)
        elif "drafter detached" in line:
            counts["detached_windows"] += 1
        elif "did not pay" in line:
            counts["attached_plain_windows"] += 1


def since(tag: str, before: Counter) -> dict:
    """What ``tag``'s engine did since ``before`` (a copy of ``EVENTS[tag]``): detaches, attaches, and over its
    stats windows the mean share of speculative steps, the shares of windows detached / plain attached, and the
    mean drafts a round and rounds a step of the windows that speculated (below the configured chain where the policy
    shortened it; below the configured run where runs were cut short), the mean share of runs overlapped (queued behind
    the one before) over the windows that ran some; the plain steps by reason and the chain
    switches, counted over the windows that speculated; the Triton kernels compiled while serving; the engine loop's
    thread's share of its process's CPU (the rest: the process's other threads, which take turns at its GIL)."""
    d = EVENTS[tag] - before
    windows, drafted, spec_windows = d["windows"], d["drafted_windows"], d["spec_windows"]
    return {"detaches": d["detaches"], "attaches": d["attaches"], "joined": d["joined"], "windows": windows,
            "spec_step_share": round(d["spec_percent_sum"] / 100 / windows, 3) if windows else None,
            "detached_share": round(d["detached_windows"] / windows, 3) if windows else None,
            "attached_plain_share": round(d["attached_plain_windows"] / windows, 3) if windows else None,
            "drafts_per_round": round(d["drafts_tenths_sum"] / 10 / drafted, 2) if drafted else None,
            "rounds_per_step": round(d["run_tenths_sum"] / 10 / spec_windows, 2) if spec_windows else None,
            "overlapped_share": round(d["overlapped_percent_sum"] / 100 / d["run_windows"], 3) if d["run_windows"] else None,
            "plain_steps_for": {k.removeprefix("plain for "): n for k, n in d.items() if k.startswith("plain for ")},
            "chain_switches": d["chain_switches"], "kernels_compiled": d["kernels_compiled"],
            "engine_thread_share": (round(d["engine_thread_hundredths"] / d["host_cpu_hundredths"], 2)
                                    if d["host_cpu_hundredths"] else None)}
