"""bench/cpu_pins.py: with TANDEM_BENCH_PIN=1 each role of a REST bench's stacks runs on CPUs of its own, on distinct
physical cores (SMT siblings kept free of other roles), the same for every stack; the clients get the rest."""

from __future__ import annotations

from bench_modules import import_bench

(cpu_pins,) = import_bench("cpu_pins")


def test_each_role_gets_its_own_physical_cores_and_the_clients_the_rest(monkeypatch):
    # 10 physical cores with two SMT threads each: CPU k and k + 10 are siblings
    monkeypatch.setattr(cpu_pins, "_physical_cores", lambda cpus: [[k, k + 10] for k in range(10)])
    plan = cpu_pins.plan(set(range(20)))
    assert plan["verifier"] == {0, 1} and plan["drafter"] == {2, 3} and plan["gateway"] == {4, 5}
    assert plan["clients"] == set(range(6, 10)) | set(range(16, 20))  # (no sibling of a role's CPU)


def test_too_few_cores_leave_the_processes_unpinned(monkeypatch):
    monkeypatch.setattr(cpu_pins, "_physical_cores", lambda cpus: [[k] for k in range(6)])
    assert cpu_pins.plan(set(range(6))) is None


def test_a_process_started_as_a_role_runs_on_its_cpus_and_the_bench_keeps_its_own(monkeypatch):
    import os
    import subprocess
    import sys

    own = os.sched_getaffinity(0)
    one = {min(own)}
    monkeypatch.setattr(cpu_pins, "_PLAN", {"verifier": one, "clients": own})
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    with cpu_pins.as_role("verifier"):
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(sorted(one)) and os.sched_getaffinity(0) == own
    monkeypatch.setattr(cpu_pins, "_PLAN", None)  # (off: as it started)
    with cpu_pins.as_role("verifier"):
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(sorted(own))
