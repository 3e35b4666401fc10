#!/usr/bin/env python3
"""What the verifier's gRPC front costs its engine, on any machine: the real verifier (verifier/serve.py: its server,
engine loop, metrics, spans) in a process of its own, with a stand-in engine whose step holds the GIL ``--busy-us``
(the host's work of a step: staging, launches, read-back) and then releases it ``--wait-us`` (waiting for the GPU),
and emits ``--tokens`` tokens for each running request; closed-loop gRPC clients in other processes stream
``--concurrency`` requests of 120 tokens. The engine alone would make concurrency × tokens ÷ (busy + wait) tokens a
second; what the front's handling of the streams takes from it (the GIL both threads share) shows as the shortfall.
Prints tokens/s, that share of the engine-alone rate, and the verifier's CPU µs a message and a token.

    python bench/verifier_front.py [--concurrency 8 64] [--tokens 1 12] [--busy-us 300] [--wait-us 300]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

VERIFIER = r'''
import asyncio, json, os, sys, time
from types import SimpleNamespace
sys.path.insert(0, os.getcwd())
import uvloop
from tandem.engine.config import EngineConfig
from tandem.engine.request import FinishReason
from tandem.engine.step import StepOutput
from tandem.training.demo import SHIPPED
import verifier.serve as serve
from verifier.config import VerifierConfig

TOKENS, BUSY_S, WAIT_S, PORT = int(sys.argv[1]), float(sys.argv[2]) / 1e6, float(sys.argv[3]) / 1e6, int(sys.argv[4])
if float(sys.argv[5]):
    sys.setswitchinterval(float(sys.argv[5]) / 1e6)
STEPS = [0]

class StandInEngine:
    """What the engine loop reads of an engine; each step busy (GIL held), then waiting (GIL released)."""
    def __init__(self):
        self.scheduler = SimpleNamespace(running=[], waiting=[], preemptions=0)
        self.allocator = SimpleNamespace(num_free=1024, capacity_pages=1024)
        self.drafts = SimpleNamespace(detached=False, up=lambda: False, settle=lambda: None)
        self.chain = SimpleNamespace(switches=0)
        self.proposer = self.prefix_cache = self.last_step = self.traffic = None
        self.plain_reason, self.requests, self.left = "", {}, {}
    def add_request(self, prompt, params, rid, spec=None, cache_salt=""):
        self.left[rid] = params.max_new_tokens
    def abort(self, rid):
        self.left.pop(rid, None)
    def has_unfinished(self):
        return bool(self.left)
    def step(self):
        end = time.perf_counter() + BUSY_S
        while time.perf_counter() < end:
            pass
        time.sleep(WAIT_S)
        STEPS[0] += 1
        outs = []
        for rid, left in list(self.left.items()):
            k = min(TOKENS, left)
            self.left[rid] = left - k
            done = left == k
            if done:
                del self.left[rid]
            outs.append(StepOutput(rid, [7] * k, FinishReason.LENGTH if done else None))
        return outs
    def shutdown(self, release=True):
        pass

serve.build_engine = lambda cfg, metrics: (StandInEngine(), None, None)
cfg = VerifierConfig(EngineConfig(model=os.path.join(SHIPPED, "target")),
                     port=PORT, log_stats_interval_s=0.0)

async def main():
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.ensure_future(serve.serve(cfg, ready, stop))
    await ready.wait()
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    t = os.times()
    print(json.dumps({"steps": STEPS[0], "cpu_s": t.user + t.system}), flush=True)
    stop.set()
    await task

uvloop.run(main())
'''

CLIENT = r'''
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[4])
import grpc
from tandem.rpc.verifier.v1 import verifier_pb2 as pb
PORT, STREAMS, SECONDS = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

async def main():
    async with grpc.aio.insecure_channel(f"127.0.0.1:{PORT}") as channel:
        call = channel.unary_stream("/tandem.rpc.verifier.v1.Verifier/Generate",
                                    request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=pb.GenerateResponse.FromString)
        counts = [0, 0]  # tokens, messages
        end = time.perf_counter() + SECONDS
        async def stream():
            while time.perf_counter() < end:
                request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8],
                                             sampling=pb.SamplingParams(max_new_tokens=120, ignore_eos=True))
                async for message in call(request):
                    counts[0] += len(message.token_ids)
                    counts[1] += 1
        started = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(STREAMS)))
        print(json.dumps({"tokens": counts[0], "messages": counts[1], "seconds": time.perf_counter() - started}))

asyncio.run(main())
'''


def measure(concurrency: int, tokens: int, busy_us: float, wait_us: float, seconds: float, clients: int = 2,
            spy_to: Path | None = None, switch_us: float = 0.0) -> dict:
    from spy import finish, start
    from tandem.service_probe import free_port

    port = free_port()
    verifier = subprocess.Popen([sys.executable, "-c", VERIFIER, str(tokens), str(busy_us), str(wait_us), str(port),
                                 str(switch_us)],
                                cwd=os.environ.get("TANDEM_BENCH_OLD_TREE", ROOT), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=dict(os.environ, TANDEM_INTERNAL_SECRET=""))
    try:
        assert verifier.stdout.readline().strip() == "ready"
        before, threads_before = _cpu_s(verifier.pid), _thread_cpu_s(verifier.pid)
        spy = start(verifier.pid, seconds - 1, spy_to, 0.5) if spy_to else None
        shares = [concurrency // clients + (i < concurrency % clients) for i in range(clients)]
        procs = [subprocess.Popen([sys.executable, "-c", CLIENT, str(port), str(n), str(seconds), str(ROOT)],
                                  stdout=subprocess.PIPE, text=True) for n in shares if n]
        results = [json.loads(p.communicate()[0]) for p in procs]
        finish(spy)
        cpu = _cpu_s(verifier.pid) - before
        threads = _thread_cpu_s(verifier.pid)
        verifier.stdin.write("\n")
        verifier.stdin.flush()
        verifier.stdout.readline()
    finally:
        verifier.kill()
    streamed = sum(r["tokens"] for r in results)
    messages = sum(r["messages"] for r in results)
    wall = max(r["seconds"] for r in results)
    alone = concurrency * tokens / ((busy_us + wait_us) / 1e6)
    return {"tok_s": streamed / wall, "of_engine_alone": streamed / wall / alone, "verifier_cpu_share": cpu / wall,
            "us_per_message": 1e6 * cpu / messages, "us_per_token": 1e6 * cpu / streamed,
            "tokens_per_message": streamed / messages,
            "thread_cpu_share": {name: round((s - threads_before.get(name, 0.0)) / wall, 3) for name, s in threads.items()}}


def _cpu_s(pid: int, task: str = "") -> float:
    fields = Path(f"/proc/{pid}{task}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds by thread name (threads of one name summed): which of the engine loop, the server's event loop and
    gRPC's own threads the verifier's CPU went to."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[name] = out.get(name, 0.0) + _cpu_s(pid, f"/task/{task.name}")
        except OSError:  # (a thread that ended meanwhile)
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 12], help="tokens a request gets each step")
    ap.add_argument("--busy-us", type=float, default=300.0, help="a step's host work, the GIL held")
    ap.add_argument("--wait-us", type=float, default=300.0, help="a step's wait for the device, the GIL released")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--switch-interval-us", type=float, default=0.0, help="the verifier's GIL switch interval (0: Python's)")
    ap.add_argument("--spy", type=Path, default=None, metavar="DIR",
                    help="py-spy the verifier during each load: DIR/c<concurrency>-k<tokens>.txt (bench/spy.py folds them)")
    a = ap.parse_args()
    for c in a.concurrency:
        for k in a.tokens:
            r = measure(c, k, a.busy_us, a.wait_us, a.seconds, spy_to=a.spy and a.spy / f"c{c}-k{k}.txt",
                        switch_us=a.switch_interval_us)
            print(f"concurrency {c:3d}, {k:2d} token(s) a step ({a.busy_us:g} µs busy + {a.wait_us:g} µs waiting): "
                  f"{r['tok_s']:8.0f} tok/s = {r['of_engine_alone']:.2f} of the engine alone; verifier CPU share "
                  f"{r['verifier_cpu_share']:.2f}, {r['us_per_message']:.0f} µs a message "
                  f"({r['tokens_per_message']:.1f} tokens), {r['us_per_token']:.1f} µs a token; by thread: "
                  + ", ".join(f"{name} {share:.2f}" for name, share in r["thread_cpu_share"].items() if share >= 0.01),
                  flush=True)


if __name__ == "__main__":
    main()
