#!/usr/bin/env python3
"""What one device-side hand-off between two processes on one GPU costs: the first experiment for
queuing the service pair's rounds on the device (docs/benchmarks.md, session of 2026-12-01).

In process, a run of chain rounds is queued on one stream and the GPU never waits for the host.
Across the drafter and the verifier, each round would hand the GPU over twice: the drafter's draft,
then the verifier's verify (waiting on an interprocess event the drafter recorded), then the
drafter's extend (waiting on one the verifier recorded). Both hosts can queue a whole run ahead, so
what is left is the device's own cost of switching between the two processes' contexts (time-sliced,
no MPS). This measures it: two processes alternate ``--rounds`` short kernels (``torch.cuda._sleep``
of ``--work-us``), each waiting on the other's interprocess event of the same round, both hosts
queuing ahead; and, for reference, the same alternation between two streams of one process. The
per-hand-off cost is (wall time − kernel time) / hand-offs.

    python3 bench/ipc_handoff.py [--rounds 400] [--work-us 200] [--out ipc_handoff.json]

Host ordering: ``cudaStreamWaitEvent`` binds to the last record *issued* on the event, so a side
waits on round r's event only after the other side's host has issued that record (a shared
counter), and every round has its own events (none is recorded twice).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.multiprocessing as mp


def _cycles(work_us: float) -> int:
    """``torch.cuda._sleep`` cycles for about ``work_us`` of device time (measured, not assumed)."""
    probe = 1_000_000
    torch.cuda._sleep(probe)  # a first launch loads the kernel
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(probe)
    b.record()
    b.synchronize()
    return int(probe * work_us / (a.elapsed_time(b) * 1e3))


def _events(rounds: int) -> list[torch.cuda.Event]:
    return [torch.cuda.Event(interprocess=True) for _ in range(rounds)]


def _side(rank: int, rounds: int, cycles: int, handles, mine_q, issued, go) -> None:
    """One process's alternation: rank 0 runs rounds' first kernels, rank 1 their second."""
    torch.cuda.set_device(0)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    mine = _events(rounds)
    mine_q.put([e.ipc_handle() for e in mine])
    theirs = [torch.cuda.Event.from_ipc_handle(0, h) for h in handles.get()]
    go.wait()
    stream = torch.cuda.current_stream()
    for r in range(rounds):
        if rank == 1 or r > 0:  # rank 1's round r follows rank 0's round r; rank 0's follows rank 1's r-1
            need = r if rank == 1 else r - 1
            while issued[1 - rank] <= need:  # the other host has issued that record
                pass
            stream.wait_event(theirs[need])
        torch.cuda._sleep(cycles)
        mine[r].record(stream)
        issued[rank] = r + 1
    torch.cuda.synchronize()


def cross_process(rounds: int, cycles: int) -> float:
    """Wall seconds for ``rounds`` round trips between two processes, from the first launch to the last."""
    ctx = mp.get_context("spawn")
    issued = ctx.Array("l", [0, 0], lock=False)
    go = ctx.Event()
    q0, q1 = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_side, args=(1, rounds, cycles, q0, q1, issued, go))
    child.start()
    # The parent is rank 0: its event handles go to the child on q0, the child's come back on q1.
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    mine = _events(rounds)
    q0.put([e.ipc_handle() for e in mine])
    theirs = [torch.cuda.Event.from_ipc_handle(0, h) for h in q1.get()]
    stream = torch.cuda.current_stream()
    go.set()
    started = time.perf_counter()
    for r in range(rounds):
        if r > 0:
            while issued[1] <= r - 1:
                pass
            stream.wait_event(theirs[r - 1])
        torch.cuda._sleep(cycles)
        mine[r].record(stream)
        issued[0] = r + 1
    while issued[1] < rounds:
        pass
    theirs[rounds - 1].synchronize()
    elapsed = time.perf_counter() - started
    child.join(timeout=60)
    return elapsed


def one_process(rounds: int, cycles: int) -> float:
    """The same alternation between two streams of one process (events within one context)."""
    s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
    e0, e1 = [torch.cuda.Event() for _ in range(rounds)], [torch.cuda.Event() for _ in range(rounds)]
    torch.cuda.synchronize()
    started = time.perf_counter()
    for r in range(rounds):
        if r > 0:
            s0.wait_event(e1[r - 1])
        with torch.cuda.stream(s0):
            torch.cuda._sleep(cycles)
        e0[r].record(s0)
        s1.wait_event(e0[r])
        with torch.cuda.stream(s1):
            torch.cuda._sleep(cycles)
        e1[r].record(s1)
    e1[-1].synchronize()
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--work-us", type=float, default=200.0, help="device time of each kernel")
    ap.add_argument("--out", default="ipc_handoff.json")
    args = ap.parse_args()
    cycles = _cycles(args.work_us)
    kernels_s = 2 * args.rounds * args.work_us / 1e6
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds,
              "work_us": args.work_us}
    for name, fn in (("one_process", one_process), ("two_processes", cross_process)):
        wall = min(fn(args.rounds, cycles) for _ in range(3))
        per_handoff_us = (wall - kernels_s) / (2 * args.rounds) * 1e6
        report[name] = {"wall_s": wall, "per_handoff_us": per_handoff_us}
        print(f"{name:14s}: {wall * 1e3:8.1f} ms for {2 * args.rounds} kernels of {args.work_us:.0f} us: "
              f"{per_handoff_us:6.1f} us per hand-off", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
