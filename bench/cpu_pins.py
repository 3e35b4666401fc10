"""The same CPUs for the same role in every stack a REST bench compares (TANDEM_BENCH_PIN=1).

Stacks compared by interleaved loads are separate processes the OS places anew: over REST on the lent GPU machines a
stack's host-bound verifier ran ±12 % from one call to the next, and the same setting in two calls differed by more
than the policy's gap to it. With pinning, each role runs on CPUs of its own, on distinct physical cores, and the
same ones whichever stack runs the load (only one does at a time; the idle ones sleep): the verifier, the drafter
process and the gateway two each, the load's clients the rest. Off by default (and where fewer than 8 physical cores
are allowed): not yet compared with unpinned runs on a GPU machine.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROLES = ("verifier", "drafter", "gateway")
PER_ROLE = 2  # CPUs, each on a physical core of its own (the verifier's share reached 1.1, the gateway's 1.25)


def _physical_cores(cpus: set[int]) -> list[list[int]]:
    """``cpus`` grouped by physical core (SMT siblings together), in CPU order; one group per CPU where the topology
    cannot be read."""
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(cpus):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            key = ("cpu", str(cpu))
        cores.setdefault(key, []).append(cpu)
    return list(cores.values())


def plan(cpus: set[int] | None = None) -> dict[str, set[int]] | None:
    """Role -> its CPUs ("clients": every CPU left), or None where there are too few physical cores to give each role
    its own and the clients some."""
    cores = _physical_cores(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cores) < len(ROLES) * PER_ROLE + 2:
        return None
    out, taken = {}, set()
    for i, role in enumerate(ROLES):
        mine = cores[i * PER_ROLE:(i + 1) * PER_ROLE]
        out[role] = {core[0] for core in mine}
        taken |= {cpu for core in mine for cpu in core}  # (the siblings stay free of other roles)
    out["clients"] = {cpu for core in cores for cpu in core} - taken
    return out


_PLAN = plan() if os.environ.get("TANDEM_BENCH_PIN") == "1" else None
if _PLAN is not None:  # the bench itself (its timed requests, its threads relaying the services' logs) with the clients
    os.sched_setaffinity(0, _PLAN["clients"])


@contextlib.contextmanager
def as_role(role: str | None):
    """Processes started inside run on ``role``'s CPUs (they inherit the starting thread's; no ``preexec_fn``, which
    may deadlock in a process with threads). Start no thread inside."""
    cpus = _PLAN.get(role) if _PLAN is not None and role is not None else None
    if cpus is None:
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def describe() -> str:
    return ("not pinned" if _PLAN is None
            else "pinned: " + ", ".join(f"{role} {sorted(cpus)}" for role, cpus in _PLAN.items()))
