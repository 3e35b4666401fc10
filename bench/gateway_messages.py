#!/usr/bin/env python3
"""The gateway's CPU per streamed message, on any machine: a stand-in verifier in a process of its own streams every
answer as fast as it is read, ``--tokens`` tokens a message (1: plain decode steps; a speculative round carries ~3);
the real gateway (this process) serves it over REST to closed-loop clients in processes of their own
(bench/rest_load.py). Prints tokens/s and the gateway's CPU microseconds per message and per token: over REST at
concurrency 64 the gateway, not the engine, bounds a small target, and its cost goes by messages.

    python bench/gateway_messages.py [--tokens 1 3] [--concurrency 64] [--seconds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

VOCAB = 512
STAND_IN = r'''
import asyncio, sys
sys.path.insert(0, sys.argv[3])
import grpc, uvloop
from tandem.rpc.verifier.v1 import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
K, VOCAB = int(sys.argv[1]), int(sys.argv[2])

class StandIn(pb_grpc.VerifierServicer):
    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(model="stand-in", vocab_size=VOCAB, max_context=4096, eos_token_ids=[1])

    async def Generate(self, request, context):
        n, sent, base = request.sampling.max_new_tokens, 0, sum(request.prompt_token_ids)
        while sent < n:
            chunk = [3 + (base + sent + j) % (VOCAB - 3) for j in range(min(K, n - sent))]
            sent += len(chunk)
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=chunk, completion_tokens=sent,
                                      prompt_tokens=len(request.prompt_token_ids),
                                      finish_reason="length" if sent == n else "")

async def main():
    server = grpc.aio.server()
    pb_grpc.add_VerifierServicer_to_server(StandIn(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

uvloop.run(main())
'''


def measure(tokens: int, concurrency: int, seconds: float, model_dir: str) -> dict:
    import uvloop

    import rest_load
    from gateway.config import GatewayConfig
    from gateway.server import Gateway

    stand_in = subprocess.Popen([sys.executable, "-c", STAND_IN, str(tokens), str(VOCAB), str(ROOT)],
                                stdout=subprocess.PIPE, text=True)
    loop = uvloop.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        port = int(stand_in.stdout.readline())
        cfg = GatewayConfig(verifier=f"127.0.0.1:{port}", model_dir=model_dir, host="127.0.0.1", port=0, grpc_port=0)
        gateway = Gateway(cfg)
        asyncio.run_coroutine_threadsafe(gateway.start(), loop).result(60)
        prompts = [[5 + (i * 7 + j) % 400 for j in range(64)] for i in range(64)]
        before = rest_load.cpu_seconds(os.getpid())
        load = rest_load.sustained(f"http://127.0.0.1:{gateway.port}", prompts, concurrency, 120, seconds)
        cpu = rest_load.cpu_seconds(os.getpid()) - before
        asyncio.run_coroutine_threadsafe(gateway.stop(), loop).result(30)
    finally:
        stand_in.kill()
        loop.call_soon_threadsafe(loop.stop)
    total = load["tok_s"] * load["seconds"]
    return {"tokens_per_message": tokens, "tok_s": load["tok_s"], "gateway_cpu_share": cpu / load["seconds"],
            "client_cpu_share": load["client_cpu_share"], "gateway_us_per_token": 1e6 * cpu / total,
            "gateway_us_per_message": 1e6 * cpu / (total / tokens)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 3], help="tokens a message (one load each)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=6.0)
    a = ap.parse_args()
    from tandem.training.stdlib_text import train_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        train_tokenizer(Path(folder), vocab_size=VOCAB)
        for k in a.tokens:
            r = measure(k, a.concurrency, a.seconds, folder)
            print(f"{k} token(s) a message, concurrency {a.concurrency}: {r['tok_s']:.0f} tok/s; gateway CPU share "
                  f"{r['gateway_cpu_share']:.2f} (clients {r['client_cpu_share']:.2f}), "
                  f"{r['gateway_us_per_message']:.0f} µs a message, {r['gateway_us_per_token']:.0f} µs a token", flush=True)


if __name__ == "__main__":
    main()
