#!/usr/bin/env python3
"""What one gRPC message each way costs by itself between two Python processes (grpc.aio, the
drafter's bidirectional Rounds stream and message types, loopback), with nothing else running:
an echo server that holds each message ``--work-ms`` (busy, as a draft round holds the drafter's
loop) before answering, and a client that drives the stream as the verifier does (one
run_until_complete per round on a private loop, ``--gap-ms`` of its own work between rounds). Prints
the round trip minus the server's work: the floor under bench/boundary.py's "rest of the round trip".

    python bench/grpc_floor.py [--rounds 300] [--work-ms 0 4] [--gap-ms 5]

Run as ``--serve PORT WORK_MS`` it is the echo server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from tandem.rpc.drafter.v1 import drafter_pb2 as pb  # noqa: E402
from tandem.rpc.drafter.v1 import drafter_pb2_grpc as pb_grpc  # noqa: E402


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def serve(port: int, work_s: float) -> None:
    class Echo(pb_grpc.DrafterServicer):
        async def Rounds(self, request_iterator, context):
            async for message in request_iterator:
                busy(work_s)
                yield pb.DrafterMessage(drafts=pb.Drafts(seq=message.round.seq))

    async def main():
        server = grpc.aio.server()
        pb_grpc.add_DrafterServicer_to_server(Echo(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def measure(port: int, rounds: int, work_s: float, gap_s: float) -> float:
    """→ mean microseconds per round trip, minus the server's work."""
    loop = asyncio.new_event_loop()

    async def open_stream():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        return channel, pb_grpc.DrafterStub(channel).Rounds()

    channel, call = loop.run_until_complete(open_stream())

    async def exchange(seq: int):
        await call.write(pb.VerifierMessage(round=pb.Round(seq=seq)))
        return await call.read()

    total = 0.0
    for i in range(rounds + 50):  # the first 50 warm up
        started = time.perf_counter()
        loop.run_until_complete(exchange(i))
        if i >= 50:
            total += time.perf_counter() - started
        busy(gap_s)
    loop.run_until_complete(channel.close())
    return (total / rounds - work_s) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--work-ms", type=float, nargs="+", default=[0.0, 4.0])
    p.add_argument("--gap-ms", type=float, default=5.0)
    p.add_argument("--serve", nargs=2, metavar=("PORT", "WORK_MS"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.serve:
        serve(int(args.serve[0]), float(args.serve[1]) / 1e3)
        return 0
    from tandem.service_probe import free_port

    rows = []
    for work_ms in args.work_ms:
        for gap_ms in (0.0, args.gap_ms):
            port = free_port()
            server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), str(work_ms)])
            try:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as probe:
                    grpc.channel_ready_future(probe).result(timeout=60)  # the echo server is up
                us = measure(port, args.rounds, work_ms / 1e3, gap_ms / 1e3)
            finally:
                server.terminate()
                server.wait(10)
            rows.append({"server_work_ms": work_ms, "client_gap_ms": gap_ms, "round_trip_minus_work_us": us})
            print(f"server work {work_ms:4.1f} ms, client gap {gap_ms:4.1f} ms: {us:7.0f} us per round trip "
                  "beyond the server's work", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
