"""One drafter round's timeline from a trace written by ``python -m drafter --profile-rounds N
--profile-dir DIR`` (a Chrome trace of the torch profiler): the host's top-level ops with the time
between them (Python), and the GPU's busy spans, relative to the end of the previous round.

Rounds are told apart by their longest host call, the device→host copy that waits for the draft's
tokens (the last thing a round does). Usage: ``python bench/trace_round.py TRACE.json [--round K]``."""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--round", type=int, default=10, help="which round (between the K-th and K+1-th read-back)")
    p.add_argument("--min-wait-us", type=float, default=50.0, help="a host copy longer than this ends a round")
    a = p.parse_args(argv)
    events = sorted((e for e in json.load(open(a.trace))["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"])
    ends = [e["ts"] + e["dur"] for e in events if e["name"] == "cudaMemcpyAsync" and e["dur"] > a.min_wait_us]
    if len(ends) < a.round + 2:
        p.error(f"the trace has {len(ends)} rounds")
    start, stop = ends[a.round], ends[a.round + 1]
    host, last_end = [], -1.0
    for e in events:  # top-level host ops and runtime calls of the round
        if start <= e["ts"] < stop and e.get("cat") in ("cpu_op", "cuda_runtime") and e["ts"] >= last_end:
            host.append(e)
            last_end = e["ts"] + e["dur"]
    print(f"round {a.round}: {stop - start:.1f} us from the previous round's end")
    previous_end = start
    for e in host:
        print(f"  host {e['ts'] - start:9.1f} us  after {e['ts'] - previous_end:7.1f}  takes {e['dur']:7.1f}  {e['name']}")
        previous_end = e["ts"] + e["dur"]
    busy = []
    for e in events:
        if start <= e["ts"] < stop and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            s, f = e["ts"], e["ts"] + e["dur"]
            if busy and s <= busy[-1][1] + 5.0:  # gaps under 5 us: one span
                busy[-1][1], busy[-1][2] = max(busy[-1][1], f), busy[-1][2] + 1
            else:
                busy.append([s, f, 1])
    for s, f, n in busy:
        if f - s > 5.0:
            print(f"  GPU  {s - start:9.1f} us  busy {f - s:7.1f} us  ({n} ops)")
    print(f"GPU busy {sum(f - s for s, f, _ in busy):.1f} us of the round")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
