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


def _connect(rounds: int, send, receive) -> tuple[list, list]:
    """This side's interprocess events (one per round, their handles sent) and the other side's."""
    torch.cuda.set_device(0)
    torch.cuda._sleep(1000)  # a first launch loads the kernel
    torch.cuda.synchronize()
    mine = [torch.cuda.Event(interprocess=True) for _ in range(rounds)]
    send.put([e.ipc_handle() for e in mine])
    return mine, [torch.cuda.Event.from_ipc_handle(0, h) for h in receive.get()]


def _alternate(rank: int, cycles: int, mine: list, theirs: list, issued) -> None:
    """Queue this side's kernels: rank 0 runs each round's first kernel, after rank 1's of the round
    before; rank 1 each round's second, after rank 0's of the same round."""
    stream = torch.cuda.current_stream()
    for r in range(len(mine)):
        after = r if rank == 1 else r - 1
        if after >= 0:
            while issued[1 - rank] <= after:  # the other host has issued that record
                pass
            stream.wait_event(theirs[after])
        torch.cuda._sleep(cycles)
        mine[r].record(stream)
        issued[rank] = r + 1


def _child(rounds: int, cycles: int, receive, send, issued, go) -> None:
    mine, theirs = _connect(rounds, send, receive)
    go.wait()
    _alternate(1, cycles, mine, theirs, issued)
    torch.cuda.synchronize()


def cross_process(rounds: int, cycles: int) -> float:
    """Wall seconds for ``rounds`` round trips between two processes, from the first launch to the last
    kernel's end. The parent is rank 0; event handles go to the child on one queue and come back on the
    other."""
    ctx = mp.get_context("spawn")
    issued = ctx.Array("l", [0, 0], lock=False)
    go = ctx.Event()
    to_child, from_child = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child, args=(rounds, cycles, to_child, from_child, issued, go))
    child.start()
    mine, theirs = _connect(rounds, to_child, from_child)
    go.set()
    started = time.perf_counter()
    _alternate(0, cycles, mine, theirs, issued)
    while issued[1] < rounds:
        pass
    theirs[-1].synchronize()
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
