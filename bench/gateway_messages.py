#!/usr/bin/env python3
"""The gateway's CPU per streamed message, on any machine: a stand-in verifier in a process of its own streams every
answer as fast as it is read, ``--tokens`` tokens a message (1: plain decode steps; a speculative round carries ~3);
or, with ``--step-ms``, as a stand-in engine steps (``--tokens`` a request each step), pacing its streams as the
verifier does when the gateway asks (``--max-interval-ms``: the gateway's --max-message-interval-ms, 0 off); the real
gateway (this process) serves it over REST to closed-loop clients in processes of their own (bench/rest_load.py).
Prints tokens/s, tokens a message and the gateway's CPU microseconds per message and per token: over REST at
concurrency 64 the gateway, not the engine, bounds a small target, and its cost goes by messages.

    python bench/gateway_messages.py [--tokens 1 3] [--step-ms 1] [--max-interval-ms 0 50] [--concurrency 64]
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
sys.path.insert(0, sys.argv[4])
import grpc, uvloop
from tandem.rpc.verifier.v1 import verifier_pb2 as pb, verifier_pb2_grpc as pb_grpc
K, VOCAB, STEP_S = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) / 1e3
STREAMS = {}  # request id -> its queue of token counts (an engine's steps)
SENT = [0, 0, 0]  # messages, tokens, the longest interval a stream was asked for (µs)

async def engine():  # every STEP_S, K tokens for every running stream (an engine stepping the batch)
    while True:
        await asyncio.sleep(STEP_S)
        for q in list(STREAMS.values()):
            q.put_nowait(K)

class StandIn(pb_grpc.VerifierServicer):
    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(model="stand-in", vocab_size=VOCAB, max_context=4096, eos_token_ids=[1])

    async def Generate(self, request, context):
        n, sent, base = request.sampling.max_new_tokens, 0, sum(request.prompt_token_ids)
        pace, sent_at, loop = request.message_interval_us / 1e6, None, asyncio.get_running_loop()
        SENT[2] = max(SENT[2], request.message_interval_us)
        q = STREAMS[request.request_id] = asyncio.Queue()
        try:
            while sent < n:
                k = await q.get() if STEP_S else K
                if pace and sent_at is not None:  # as verifier/server.py paces: what comes until then, the end at once
                    try:
                        async with asyncio.timeout_at(sent_at + pace):
                            while sent + k < n:
                                k += await q.get()
                    except TimeoutError:
                        pass
                while not q.empty():
                    k += q.get_nowait()
                chunk = [3 + (base + sent + j) % (VOCAB - 3) for j in range(min(k, n - sent))]
                sent += len(chunk)
                SENT[0], SENT[1] = SENT[0] + 1, SENT[1] + len(chunk)
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=chunk, completion_tokens=sent,
                                          prompt_tokens=len(request.prompt_token_ids),
                                          finish_reason="length" if sent == n else "")
                sent_at = loop.time()
        finally:
            STREAMS.pop(request.request_id, None)

async def main():
    server = grpc.aio.server()
    pb_grpc.add_VerifierServicer_to_server(StandIn(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    if STEP_S:
        asyncio.ensure_future(engine())
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # until told: messages, tokens
    print(*SENT, flush=True)

uvloop.run(main())
'''


def measure(tokens: int, step_ms: float, interval_ms: float, concurrency: int, seconds: float, model_dir: str) -> dict:
    import uvloop

    import rest_load
    from gateway.config import GatewayConfig
    from gateway.server import Gateway

    stand_in = subprocess.Popen([sys.executable, "-c", STAND_IN, str(tokens), str(VOCAB), str(step_ms), str(ROOT)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    loop = uvloop.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        port = int(stand_in.stdout.readline())
        cfg = GatewayConfig(verifier=f"127.0.0.1:{port}", model_dir=model_dir, host="127.0.0.1", port=0, grpc_port=0,
                            max_message_interval_ms=interval_ms)
        gateway = Gateway(cfg)
        asyncio.run_coroutine_threadsafe(gateway.start(), loop).result(60)
        prompts = [[5 + (i * 7 + j) % 400 for j in range(64)] for i in range(64)]
        before = rest_load.cpu_seconds(os.getpid())
        load = rest_load.sustained(f"http://127.0.0.1:{gateway.port}", prompts, concurrency, 120, seconds)
        cpu = rest_load.cpu_seconds(os.getpid()) - before
        asyncio.run_coroutine_threadsafe(gateway.stop(), loop).result(30)
        stand_in.stdin.write("\n")
        stand_in.stdin.flush()
        messages, streamed, longest = map(int, stand_in.stdout.readline().split())
    finally:
        stand_in.kill()
        loop.call_soon_threadsafe(loop.stop)
    return {"tok_s": load["tok_s"], "gateway_cpu_share": cpu / load["seconds"], "client_cpu_share": load["client_cpu_share"],
            "tokens_per_message": streamed / messages, "gateway_us_per_token": 1e6 * cpu / streamed,
            "gateway_us_per_message": 1e6 * cpu / messages, "longest_interval_ms": longest / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 3],
                    help="tokens a request gets each step (a plain step's 1, a round's ~3): one load each")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="the stand-in engine's step (0: every message as soon as the last was read)")
    ap.add_argument("--max-interval-ms", type=float, nargs="+", default=[0.0],
                    help="the gateway's --max-message-interval-ms (0: no pacing): one load each")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=6.0)
    a = ap.parse_args()
    if a.step_ms <= 0 and any(a.max_interval_ms):
        ap.error("pacing (--max-interval-ms > 0) needs a stand-in engine that steps (--step-ms > 0)")
    from tandem.training.stdlib_text import train_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        train_tokenizer(Path(folder), vocab_size=VOCAB)
        for k in a.tokens:
            for interval in a.max_interval_ms:
                r = measure(k, a.step_ms, interval, a.concurrency, a.seconds, folder)
                print(f"{k} token(s) a step of {a.step_ms:g} ms, pacing up to {interval:g} ms, concurrency {a.concurrency}: "
                      f"{r['tok_s']:.0f} tok/s, {r['tokens_per_message']:.1f} tokens a message (paced at up to "
                      f"{r['longest_interval_ms']:.1f} ms); gateway CPU share "
                      f"{r['gateway_cpu_share']:.2f} (clients {r['client_cpu_share']:.2f}), "
                      f"{r['gateway_us_per_message']:.0f} µs a message, {r['gateway_us_per_token']:.0f} µs a token",
                      flush=True)


if __name__ == "__main__":
    main()
