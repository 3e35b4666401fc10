#!/usr/bin/env python3
"""What the verifier's gRPC front costs its engine, on any machine: the real verifier (verifier/serve.py: its server,
engine loop, metrics, spans) with a stand-in engine (bench/front_stand_in.py) whose step holds the GIL ``--busy-us``
(the host's work of a step: staging, launches, read-back) and then releases it ``--wait-us`` (waiting for the GPU),
and emits ``--tokens`` tokens for each running request; closed-loop gRPC clients in other processes stream
``--concurrency`` requests of 120 tokens. The engine loop runs on a thread beside the server (``thread``) or in a
process of its own (``process``: ``--engine-process``); the clients stream a Generate call a request (``per-request``)
or all of a client process's requests over one GenerateMany stream through the gateway's own client of it (``one``,
gateway/upstream_many.py). The engine alone would make concurrency × tokens ÷ (busy +
wait) tokens a second; what the front's handling of the streams takes from it (on a thread: the GIL they share) shows
as the shortfall. Prints tokens/s, that share of the engine-alone rate, and the verifier's CPU (its processes) a
message and a token.

    python bench/verifier_front.py [--modes thread process] [--upstream per-request one] [--concurrency 8 64] [--tokens 1 12] [--busy-us 300]
                                   [--wait-us 300] [--repeats 1]
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
import asyncio, os, sys
sys.path[:0] = [os.getcwd(), sys.argv[3]]
import uvloop
from tandem.engine.config import EngineConfig
from tandem.training.demo import SHIPPED
import front_stand_in
import verifier.serve as serve
from verifier.config import VerifierConfig

PORT, SWITCH_US, PROCESS = int(sys.argv[1]), float(sys.argv[2]), sys.argv[4] == "process"
if SWITCH_US:
    sys.setswitchinterval(SWITCH_US / 1e6)
serve.build_engine = front_stand_in.build
cfg = VerifierConfig(EngineConfig(model=os.path.join(SHIPPED, "target")), port=PORT, log_stats_interval_s=0.0,
                     engine_process=PROCESS)

async def main():
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.ensure_future(serve.serve(cfg, ready, stop))
    await ready.wait()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    stop.set()
    await task

if __name__ == "__main__":
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

# The same load over one GenerateMany stream, through the gateway's own client of it (gateway/upstream_many.py);
# "messages" counts the generations' responses (what a stream each would have sent), "batches" the stream's messages.
CLIENT_ONE_STREAM = r'''
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[4])
import grpc
from gateway.upstream_many import ManyStream
from tandem.rpc.verifier.v1 import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
PORT, STREAMS, SECONDS = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

async def main():
    async with grpc.aio.insecure_channel(f"127.0.0.1:{PORT}") as channel:
        stub = pb_grpc.VerifierStub(channel)
        batches = [0]
        def opened(commands):
            call = stub.GenerateMany(commands)
            async def counted():
                async for batch in call:
                    batches[0] += 1
                    yield batch
            return counted()
        many = ManyStream(opened)
        counts = [0, 0]
        end = time.perf_counter() + SECONDS
        async def stream():
            while time.perf_counter() < end:
                request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8],
                                             sampling=pb.SamplingParams(max_new_tokens=120, ignore_eos=True))
                call = many.start(request, [])
                while (message := await call.read()) is not grpc.aio.EOF:
                    counts[0] += len(message.token_ids)
                    counts[1] += 1
        started = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(STREAMS)))
        await many.close()
        print(json.dumps({"tokens": counts[0], "messages": counts[1], "batches": batches[0],
                          "seconds": time.perf_counter() - started}))

asyncio.run(main())
'''


def step_alone_s(tokens: int, busy_us: float, wait_us: float, steps: int = 300) -> float:
    """The stand-in's step by itself on this host (its sleep overshoots the asked wait: ~0.57 ms more on a 2-core
    VM), the "engine alone" the loads are set against."""
    import time

    os.environ.update(TANDEM_FRONT_TOKENS=str(tokens), TANDEM_FRONT_BUSY_US=str(busy_us), TANDEM_FRONT_WAIT_US=str(wait_us))
    from front_stand_in import StandInEngine
    from tandem.sampling import SamplingParams

    engine = StandInEngine()
    engine.add_request([1], SamplingParams(max_new_tokens=steps * tokens), "r")
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - started) / steps


def measure(mode: str, concurrency: int, tokens: int, busy_us: float, wait_us: float, seconds: float,
            clients: int = 2, spy_to: Path | None = None, switch_us: float = 0.0, upstream: str = "per-request") -> dict:
    """One load on a fresh verifier; ``mode``: "thread" (the engine loop beside the server) or "process"
    (``--engine-process``); ``upstream``: a Generate stream a request, or one GenerateMany stream a client process. The engine alone: its step timed by itself on this host, every request given its tokens
    each step (a closed loop's gap between a client's requests costs a step: with 12 tokens a step of 120-token
    requests the ceiling is about 10/11 of it)."""
    from rest_load import cpu_seconds
    from spy import finish, start
    from tandem.service_probe import free_port

    port = free_port()
    env = dict(os.environ, TANDEM_INTERNAL_SECRET="", TANDEM_FRONT_TOKENS=str(tokens), TANDEM_FRONT_BUSY_US=str(busy_us),
               TANDEM_FRONT_WAIT_US=str(wait_us))
    verifier = subprocess.Popen([sys.executable, "-c", VERIFIER, str(port), str(switch_us), str(ROOT / "bench"), mode],
                                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert verifier.stdout.readline().strip() == "ready"
        before = cpu_seconds(verifier.pid)
        spy = start(verifier.pid, seconds - 1, spy_to, 0.5) if spy_to else None
        shares = [concurrency // clients + (i < concurrency % clients) for i in range(clients)]
        client = CLIENT_ONE_STREAM if upstream == "one" else CLIENT
        procs = [subprocess.Popen([sys.executable, "-c", client, str(port), str(n), str(seconds), str(ROOT)],
                                  stdout=subprocess.PIPE, text=True) for n in shares if n]
        results = [json.loads(p.communicate()[0]) for p in procs]
        finish(spy)
        cpu = cpu_seconds(verifier.pid) - before
        verifier.stdin.write("\n")
        verifier.stdin.flush()
        verifier.wait(30)
    finally:
        verifier.kill()
    streamed = sum(r["tokens"] for r in results)
    messages = sum(r["messages"] for r in results)
    wall = max(r["seconds"] for r in results)
    alone = concurrency * tokens / step_alone_s(tokens, busy_us, wait_us)
    return {"tok_s": streamed / wall, "of_engine_alone": streamed / wall / alone, "verifier_cpu_share": cpu / wall,
            "us_per_message": 1e6 * cpu / messages, "us_per_token": 1e6 * cpu / streamed,
            "tokens_per_message": streamed / messages,
            "messages_per_batch": messages / sum(r.get("batches", r["messages"]) for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["thread", "process"], choices=["thread", "process"],
                    help="the engine loop on a thread of the server's process, or in its own (--engine-process)")
    ap.add_argument("--upstream", nargs="+", default=["per-request", "one"], choices=["per-request", "one"],
                    help="the clients' streams: a Generate stream a request, or one GenerateMany stream a process")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 12], help="tokens a request gets each step")
    ap.add_argument("--busy-us", type=float, default=300.0, help="a step's host work, the GIL held")
    ap.add_argument("--wait-us", type=float, default=300.0, help="a step's wait for the device, the GIL released")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=1, help="loads per cell and mode, interleaved")
    ap.add_argument("--switch-interval-us", type=float, default=0.0, help="the verifier's GIL switch interval (0: Python's)")
    ap.add_argument("--spy", type=Path, default=None, metavar="DIR",
                    help="py-spy the verifier's server process during each load: DIR/<mode>-c<concurrency>-k<tokens>.txt")
    a = ap.parse_args()
    for c in a.concurrency:
        for k in a.tokens:
            for n in range(a.repeats):
                cases = [(mode, up) for mode in a.modes for up in a.upstream]
                for mode, up in cases if n % 2 == 0 else cases[::-1]:
                    r = measure(mode, c, k, a.busy_us, a.wait_us, a.seconds, switch_us=a.switch_interval_us,
                                spy_to=a.spy and a.spy / f"{mode}-{up}-c{c}-k{k}.txt", upstream=up)
                    print(f"{mode:7s} {up:11s} ({r['messages_per_batch']:4.1f} a message) concurrency {c:3d}, {k:2d} token(s) a step ({a.busy_us:g} µs busy + {a.wait_us:g} µs "
                          f"waiting): {r['tok_s']:8.0f} tok/s = {r['of_engine_alone']:.2f} of the engine alone; verifier "
                          f"CPU share {r['verifier_cpu_share']:.2f}, {r['us_per_message']:.0f} µs a message "
                          f"({r['tokens_per_message']:.1f} tokens), {r['us_per_token']:.1f} µs a token", flush=True)


if __name__ == "__main__":
    main()
