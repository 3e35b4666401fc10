#!/usr/bin/env python3
"""What one device-side hand-off between two processes on one GPU costs: the first experiment for
queuing the service pair's rounds on the device.

In process, a run of chain rounds is queued on one stream and the GPU never waits for the host.
Across the drafter and the verifier, each round would hand the GPU over twice: the drafter's draft,
then the verifier's verify (waiting on an interprocess event the drafter recorded), then the
drafter's extend (waiting on one the verifier recorded). Both hosts can queue a whole run ahead, so
what is left is the device's own cost of switching between the two processes' contexts (time-sliced,
no MPS). This measures it: two processes alternate ``--rounds`` short kernels (``torch.cuda._sleep``
of ``--work-us``), each waiting on the other's interprocess event of the same round, both hosts
queuing ahead; and, for reference, the same alternation between two streams of one process. The
per-hand-off cost is (wall time − kernel time) / hand-offs.

    python3 bench/ipc_handoff.py [--rounds 400] [--work-us 200] [--peer-work-us US] [--slots 2]
                                 [--sync events|flags] [--dead-peer] [--out ipc_handoff.json]

``--peer-work-us``: the second process's kernel length (a round's shape: the verifier's verify is several
times longer than the drafter's work). ``--slots``: events per side, reused round after round (what a
serving loop does); a shared device counter that each kernel advances only from the value the round
before left checks that the reused events order the two processes. ``--dead-peer``: what a stream waiting
on the event of a process killed with its record still queued does (the service pair's open risk).
``--sync flags``: instead of interprocess events, each side's stream waits on a flag in shared host
memory that the other side's stream writes (tandem/ring/stream_flags.py); the hosts then need no lockstep
at all, and a host can release a wait on a dead peer by writing the flag itself.

Host ordering: ``cudaStreamWaitEvent`` binds to the last record *issued* on the event, so a side
waits on round r's event only after the other side's host has issued that record (a shared
counter), and every round has its own events (none is recorded twice).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import time

import secrets

import torch
import torch.multiprocessing as mp

from tandem.ring import posix
from tandem.ring.stream_flags import StreamFlags


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


def _warm_device() -> None:
    """A first launch of the kernel, outside any timing or wait (it loads the module)."""
    torch.cuda.set_device(0)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()


def _connect(slots: int, send, receive) -> tuple[list, list]:
    """This side's interprocess events (``slots`` of them, their handles sent) and the other side's."""
    _warm_device()
    mine = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
    send.put([e.ipc_handle() for e in mine])
    return mine, [torch.cuda.Event.from_ipc_handle(0, h) for h in receive.get()]


def _alternate(rank: int, rounds: int, cycles: int, mine: list, theirs: list, issued, counter) -> None:
    """Queue this side's kernels: rank 0 runs each round's first kernel, after rank 1's of the round
    before; rank 1 each round's second, after rank 0's of the same round. Round r records slot r % S.
    A slot is recorded again only after the other host issued its wait on the slot's last record: the
    lockstep itself guarantees it (this side waited on a record the other side issued after that
    wait). Each kernel then advances the shared ``counter`` from the value its turn expects, or
    poisons it: a wrong order shows as a counter that is not 2 · rounds at the end."""
    stream, slots = torch.cuda.current_stream(), len(mine)
    for r in range(rounds):
        after = r if rank == 1 else r - 1
        if after >= 0:
            while issued[1 - rank] <= after:  # the other host has issued that record
                pass
            stream.wait_event(theirs[after % slots])
        torch.cuda._sleep(cycles)
        turn = 2 * r + rank
        counter.copy_(torch.where(counter == turn, turn + 1, -1))
        mine[r % slots].record(stream)
        issued[rank] = r + 1


def _flags(name: str, create: bool) -> StreamFlags:
    """Two flags (one written by each side) in the shared page ``name``."""
    _warm_device()
    page = (posix.create_segment if create else posix.open_segment)(name, mmap.PAGESIZE)
    return StreamFlags(page, 2, torch.device("cuda", 0))


def _alternate_flags(rank: int, rounds: int, cycles: int, flags: StreamFlags, counter) -> None:
    """``_alternate`` through flags: round r's kernel of this side sets its flag to r + 1; no host waits."""
    stream = torch.cuda.current_stream()
    for r in range(rounds):
        if rank == 1:
            flags.wait(stream, 0, r + 1)
        elif r:
            flags.wait(stream, 1, r)
        torch.cuda._sleep(cycles)
        turn = 2 * r + rank
        counter.copy_(torch.where(counter == turn, turn + 1, -1))
        flags.write(stream, rank, r + 1)


def _child(rounds: int, cycles: int, slots: int, receive, send, issued, go, counter, flags_name: str) -> None:
    if flags_name:
        flags = _flags(flags_name, create=False)
        send.put("ready")
        go.wait()
        _alternate_flags(1, rounds, cycles, flags, counter)
    else:
        mine, theirs = _connect(slots, send, receive)
        go.wait()
        _alternate(1, rounds, cycles, mine, theirs, issued, counter)
    torch.cuda.synchronize()


def cross_process(rounds: int, cycles: tuple[int, int], slots: int, sync: str = "events") -> tuple[float, bool]:
    """Wall seconds for ``rounds`` round trips between two processes, from the first launch to the last
    kernel's end, and whether the kernels ran in order. The parent is rank 0; event handles go to the
    child on one queue and come back on the other."""
    ctx = mp.get_context("spawn")
    issued = ctx.Array("l", [0, 0], lock=False)
    go = ctx.Event()
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    to_child, from_child = ctx.Queue(), ctx.Queue()
    name = f"tandem-handoff-{secrets.token_hex(6)}" if sync == "flags" else ""
    flags = _flags(name, create=True) if name else None
    try:
        child = ctx.Process(target=_child, args=(rounds, cycles[1], slots, to_child, from_child, issued, go, counter,
                                                 name))
        child.start()
        if flags is not None:
            from_child.get()
            go.set()
            started = time.perf_counter()
            _alternate_flags(0, rounds, cycles[0], flags, counter)
            while flags[1] < rounds:
                pass
        else:
            mine, theirs = _connect(slots, to_child, from_child)
            go.set()
            started = time.perf_counter()
            _alternate(0, rounds, cycles[0], mine, theirs, issued, counter)
            while issued[1] < rounds:
                pass
            theirs[(rounds - 1) % slots].synchronize()
        elapsed = time.perf_counter() - started
        child.join(timeout=60)
    finally:
        if flags is not None:  # unpinned before the mapping goes: a later mapping may reuse the address
            torch.cuda.synchronize()
            flags.close()
            posix.unlink(posix.shm_path(name))
    return elapsed, int(counter.item()) == 2 * rounds


def one_process(rounds: int, cycles: tuple[int, int], slots: int) -> tuple[float, bool]:
    """The same alternation between two streams of one process (events within one context)."""
    s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
    e0, e1 = [torch.cuda.Event() for _ in range(rounds)], [torch.cuda.Event() for _ in range(rounds)]
    torch.cuda.synchronize()
    started = time.perf_counter()
    for r in range(rounds):
        if r > 0:
            s0.wait_event(e1[r - 1])
        with torch.cuda.stream(s0):
            torch.cuda._sleep(cycles[0])
        e0[r].record(s0)
        s1.wait_event(e0[r])
        with torch.cuda.stream(s1):
            torch.cuda._sleep(cycles[1])
        e1[r].record(s1)
    e1[-1].synchronize()
    return time.perf_counter() - started, True


def _doomed_child(cycles: int, receive, send, issued, flags_name: str) -> None:
    if flags_name:
        flags = _flags(flags_name, create=False)
        send.put("ready")
        torch.cuda._sleep(cycles)  # the write below stays queued behind this kernel
        flags.write(torch.cuda.current_stream(), 1, 1)
    else:
        mine, _ = _connect(1, send, receive)
        torch.cuda._sleep(cycles)  # the record below stays queued behind this kernel
        mine[0].record()
    issued[1] = 1
    time.sleep(120)  # the parent kills this process first


def dead_peer(cycles_per_s: int, sync: str = "events", wait_s: float = 20.0, release_s: float = 3.0) -> dict:
    """A stream waits on the event (or flag) of a process that is killed (SIGKILL) while its record
    (or write) is still queued behind a ~2 s kernel: does the wait ever resolve, does the rest of this
    process's GPU work go on meanwhile, and (flags) does this host's own write ``release_s`` after the
    kill release the wait?"""
    ctx = mp.get_context("spawn")
    issued = ctx.Array("l", [0, 0], lock=False)
    to_child, from_child = ctx.Queue(), ctx.Queue()
    name = f"tandem-handoff-{secrets.token_hex(6)}" if sync == "flags" else ""
    flags = _flags(name, create=True) if name else None
    child = ctx.Process(target=_doomed_child, args=(2 * cycles_per_s, to_child, from_child, issued, name))
    child.start()
    waiting = torch.cuda.Stream()
    if flags is not None:
        from_child.get()
        while issued[1] < 1:
            pass
        flags.wait(waiting, 1, 1)
    else:
        mine, theirs = _connect(1, to_child, from_child)
        while issued[1] < 1:
            pass
        waiting.wait_event(theirs[0])
    with torch.cuda.stream(waiting):
        torch.cuda._sleep(1000)
    done_waiting = torch.cuda.Event()
    done_waiting.record(waiting)
    os.kill(child.pid, signal.SIGKILL)
    killed = time.perf_counter()
    child.join(timeout=30)
    other = torch.cuda.Stream()  # another stream of this process, queued after the kill
    with torch.cuda.stream(other):
        torch.cuda._sleep(1000)
    done_other = torch.cuda.Event()
    done_other.record(other)
    report = {"sync": sync, "child_exit": child.exitcode, "wait_resolved_s": None, "other_stream_ran_s": None}
    if flags is not None:
        report["host_released_s"] = None
    while time.perf_counter() - killed < wait_s:
        t = time.perf_counter() - killed
        if flags is not None and report["host_released_s"] is None and t >= release_s:
            report["host_released_s"] = t
            flags[1] = 1
        if report["other_stream_ran_s"] is None and done_other.query():
            report["other_stream_ran_s"] = t
        if report["wait_resolved_s"] is None and done_waiting.query():
            report["wait_resolved_s"] = t
        if None not in report.values():
            break
        time.sleep(0.001)
    if name:
        posix.unlink(posix.shm_path(name))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--work-us", type=float, default=200.0, help="device time of each kernel of the first side")
    ap.add_argument("--peer-work-us", type=float, default=None, help="the second side's (default: --work-us)")
    ap.add_argument("--slots", type=int, default=0, help="events per side, reused (0: one per round)")
    ap.add_argument("--sync", choices=("events", "flags"), default="events", help="how the processes hand over")
    ap.add_argument("--dead-peer", action="store_true", help="only the killed-recorder check")
    ap.add_argument("--out", default="ipc_handoff.json")
    args = ap.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.dead_peer:
        report["dead_peer"] = dead_peer(_cycles(1e6), args.sync)
        print(f"dead peer: {report['dead_peer']}", flush=True)
    else:
        peer_us = args.work_us if args.peer_work_us is None else args.peer_work_us
        cycles = (_cycles(args.work_us), _cycles(peer_us))
        slots = args.slots or args.rounds
        kernels_s = args.rounds * (args.work_us + peer_us) / 1e6
        report.update(rounds=args.rounds, work_us=args.work_us, peer_work_us=peer_us, slots=slots, sync=args.sync)
        for name, fn in (("one_process", one_process), ("two_processes", cross_process)):
            runs = [fn(args.rounds, cycles, slots, *(() if fn is one_process else (args.sync,))) for _ in range(3)]
            wall, ordered = min(w for w, _ in runs), all(o for _, o in runs)
            per_handoff_us = (wall - kernels_s) / (2 * args.rounds) * 1e6
            report[name] = {"wall_s": wall, "per_handoff_us": per_handoff_us, "in_order": ordered}
            print(f"{name:14s}: {wall * 1e3:8.1f} ms for {args.rounds} rounds of {args.work_us:.0f} + {peer_us:.0f} us "
                  f"({slots} slots): {per_handoff_us:6.1f} us per hand-off, in order: {ordered}", flush=True)
        extra = report["two_processes"]["wall_s"] - report["one_process"]["wall_s"]
        report["extra_per_handoff_us"] = extra / (2 * args.rounds) * 1e6
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    os._exit(0)  # a stream left waiting on a dead peer's event must not hold the exit


if __name__ == "__main__":
    main()
