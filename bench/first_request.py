#!/usr/bin/env python3
"""The first request after the services say SERVING against warm ones, split by side: the verifier and
the gateway started from their command lines on the demo pair (as ``rest_demo``), then on a warm client

- straight to the verifier's gRPC Generate: the first request, then the same prompt rotated (the prefix
  cache holds none of it) a few times — the verifier's own first-request cost;
- over the gateway's REST API (streamed, greedy, as bench/rest_load.py times it): the first, warm ones,
  and one more after ``--idle-s`` seconds idle — a slow one there means idling (GPU clocks, power states),
  not first use, is what a first request pays.

Each line gives total ms and TTFT ms. Extra environment for the verifier goes through ``--verifier-env``
(e.g. ``CUDA_MODULE_LOADING=EAGER``).

    python bench/first_request.py [--device cuda] [--mode target-only|in-process] [--idle-s 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from rest_load import http_client, run, wave  # noqa: E402
from sections_rest import SPEC_FLAGS, _wait_http  # noqa: E402
from service_pair import stop_processes  # noqa: E402
from tandem.service_probe import free_port, wait_serving  # noqa: E402

NEW_TOKENS = 64


async def _grpc_one(stub, pb, prompt: list[int], auth) -> tuple[float, float]:
    gc.collect()  # a full collection of this process (torch is imported) would be counted as the server's
    started, first = time.perf_counter(), None
    req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_new_tokens=NEW_TOKENS,
                                                                                 ignore_eos=True))
    async for msg in stub.Generate(req, timeout=300, metadata=auth):
        if first is None and msg.token_ids:
            first = time.perf_counter() - started
    return time.perf_counter() - started, first or 0.0


async def _direct(port: int, prompt: list[int], warm: int) -> None:
    import grpc

    from tandem import internal_secret
    from tandem.rpc.verifier.v1 import verifier_pb2 as pb
    from tandem.rpc.verifier.v1 import verifier_pb2_grpc as pb_grpc

    auth = internal_secret.metadata(internal_secret.load())  # (the verifier's, from the environment it inherits)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.VerifierStub(channel)
        await stub.GetModelInfo(pb.ModelInfoRequest(), metadata=auth)  # the channel connected before the clock starts
        _report("gRPC first", [await _grpc_one(stub, pb, prompt, auth)])
        _report("gRPC warm", [await _grpc_one(stub, pb, prompt[k:] + prompt[:k], auth) for k in range(1, warm + 1)])


async def _rest(base: str, prompt: list[int], warm: int, idle_s: float) -> None:
    async with http_client(4) as client:
        await client.get(f"{base}/health")
        _report("REST first", [await _rest_one(client, base, prompt)])
        _report("REST warm", [await _rest_one(client, base, prompt[k:] + prompt[:k]) for k in range(warm + 1, 2 * warm + 1)])
        await asyncio.sleep(idle_s)
        k = 2 * warm + 1
        _report(f"REST after {idle_s:g} s idle", [await _rest_one(client, base, prompt[k:] + prompt[:k])])


async def _rest_one(client, base: str, prompt: list[int]) -> tuple[float, float]:
    gc.collect()  # (as in _grpc_one)
    r = await wave(client, base, [prompt], NEW_TOKENS)
    return r["seconds"], r["ttft_s_mean"]


def _report(what: str, runs: list[tuple[float, float]]) -> None:
    print(f"{what:22s} total ms " + " ".join(f"{1e3 * s:6.1f}" for s, _ in runs)
          + " | TTFT ms " + " ".join(f"{1e3 * f:6.1f}" for _, f in runs), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--mode", choices=("target-only", "in-process"), default="target-only")
    p.add_argument("--warm", type=int, default=3, help="warm requests each way")
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--verifier-env", nargs="*", default=[], metavar="NAME=VALUE")
    args = p.parse_args()

    from tandem.training.demo import SHIPPED
    from tandem.training.demo_pair import demo_eval_prompts

    tdir, draft = Path(SHIPPED) / "target", Path(SHIPPED) / "draft"
    prompt = demo_eval_prompts(str(tdir), 1)[0]
    v_port, g_port, g_grpc = free_port(), free_port(), free_port()
    verifier = [sys.executable, "-m", "verifier", "--model", str(tdir), "--port", str(v_port), "--kv-pages", "12288",
                "--log-stats-interval", "0.5", "--device", args.device, "--dtype", args.dtype]
    if args.mode == "in-process":
        verifier += ["--drafter", "in-process", "--draft-model", str(draft), *SPEC_FLAGS]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = []
    try:
        # The verifier twice, fresh each time: its first request straight over gRPC, then behind the gateway.
        for through_gateway in (False, True):
            v_env = dict(env, **dict(kv.split("=", 1) for kv in args.verifier_env))
            started = time.perf_counter()
            procs = [subprocess.Popen(verifier, cwd=ROOT, env=v_env)]
            wait_serving(v_port, 420, procs[0], "verifier")
            print(f"verifier SERVING after {time.perf_counter() - started:.1f} s", flush=True)
            if not through_gateway:
                run(_direct(v_port, prompt, args.warm))
            else:
                procs.append(subprocess.Popen([sys.executable, "-m", "gateway", "--verifier", f"127.0.0.1:{v_port}",
                                               "--model-dir", str(tdir), "--port", str(g_port), "--grpc-port",
                                               str(g_grpc), "--log-level", "warning"], cwd=ROOT, env=env))
                _wait_http(f"http://127.0.0.1:{g_port}/health", procs[1])
                run(_rest(f"http://127.0.0.1:{g_port}", prompt, args.warm, args.idle_s))
            stop_processes(procs[::-1])
            procs = []
    finally:
        with contextlib.suppress(Exception):
            stop_processes(procs[::-1])


if __name__ == "__main__":
    main()
