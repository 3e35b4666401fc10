"""Load on the gateway's REST API as users' clients make it: streamed completions, greedy, from warm clients
in processes of their own, so that what is timed is the server (a single Python client reading 64 streams
spends ~60-200 µs of its own CPU per streamed message and capped the demo pair's rates at ~9-10k tok/s).

Used by ``sections_rest`` (``wave``, ``sustained``, ``cpu_seconds``); run as a script it is one client
process of a closed-loop load (``sustained`` starts them)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLIENT_PROCS = int(os.environ.get("TANDEM_BENCH_CLIENT_PROCS", "4"))  # client processes of a closed-loop load
START_DELAY_S = 1.5  # client processes start together this long after they are launched (their imports)


def run(coro):
    """Run ``coro`` on uvloop where it is installed (as the gateway does), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def http_client(connections: int):
    """An HTTP/1.1 client for a plain-http server: no TLS context (loading CA files costs ~30-50 ms per
    client, which a timed first request would otherwise count)."""
    import httpx

    limits = httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4)
    return httpx.AsyncClient(timeout=600.0, limits=limits, verify=False)


async def one(client, base: str, prompt: list[int], max_tokens: int) -> tuple[int, float, str]:
    """One streamed completion → (completion tokens, seconds to its first token, its text)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started, first, tokens, text = time.perf_counter(), None, 0, []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                first = first or time.perf_counter() - started
                text.append(chunk["choices"][0].get("text") or "")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, first or 0.0, "".join(text)


async def wave(client, base: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Every prompt sent at once on ``client``; → rate over the wave, mean TTFT, the texts."""
    started = time.perf_counter()
    done = await asyncio.gather(*(one(client, base, p, max_tokens) for p in prompts))
    elapsed = time.perf_counter() - started
    tokens = sum(t for t, _, _ in done)
    assert tokens == len(prompts) * max_tokens, (tokens, len(prompts), max_tokens)
    return {"tok_s": tokens / elapsed, "seconds": elapsed, "ttft_s_mean": sum(f for _, f, _ in done) / len(done),
            "texts": [t for _, _, t in done]}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` and its running children (a verifier's engine process) have used
    (Linux /proc)."""
    own, children = cpu_seconds_apart(pid)
    return own + children


def cpu_seconds_apart(pid: int) -> tuple[float, float]:
    """``cpu_seconds`` as (process ``pid``'s own, its running children's)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    return _own_cpu_seconds(pid), sum(_own_cpu_seconds(c) for c in children if os.path.exists(f"/proc/{c}"))


def _own_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sustained(base: str, prompts: list[list[int]], conc: int, max_tokens: int, seconds: float) -> dict:
    """Closed-loop load: ``conc`` clients, each sending the next prompt as soon as its last answer ends, for
    ``seconds``, spread over up to CLIENT_PROCS processes; → completion tokens/s over the requests that
    finished (a steady state, where one wave of a tiny model lasts a few tens of milliseconds and measures
    mostly noise), and the client processes' CPU share (near 1 per process: the clients, not the server,
    set the pace)."""
    procs = max(1, min(conc, CLIENT_PROCS))
    start = time.time() + START_DELAY_S
    with tempfile.TemporaryDirectory() as folder:
        prompts_file = Path(folder) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        # each client process writes its result to a file of its own: through a pipe read one process at a time, a
        # long load's results (~80 bytes a request) filled the pipes of the others, and one came back cut at 64 KiB
        outs = [Path(folder) / f"result-{j}.json" for j in range(procs)]
        workers = [subprocess.Popen([sys.executable, __file__, base, str(prompts_file), str(max_tokens), str(start),
                                     str(seconds), ",".join(str(k) for k in range(j, conc, procs)), str(conc), str(out)])
                   for j, out in enumerate(outs)]
        results = []
        for w, out in zip(workers, outs):
            if w.wait(timeout=seconds + 600) != 0:
                raise RuntimeError(f"a client process exited with code {w.returncode}")
            results.append(json.loads(out.read_text()))
    finished = [tuple(x) for r in results for x in r["finished"]]
    end = max(t for _, t, _, _ in finished)
    return {"tok_s": sum(n for n, _, _, _ in finished) / (end - start), "requests": len(finished), "seconds": end - start,
            "client_procs": procs, "client_cpu_share": max(r["cpu_s"] for r in results) / (end - start),
            # a request's life in the closed loop, and its first token's share of it (what the stack adds before the
            # engine decodes: the gateway, the verifier's front, the engine's admission and prefill)
            "ttft_ms_mean": 1e3 * sum(f for _, _, f, _ in finished) / len(finished),
            "request_ms_mean": 1e3 * sum(d for _, _, _, d in finished) / len(finished)}


async def _client_process(base: str, prompts: list[list[int]], max_tokens: int, start: float, seconds: float,
                          clients: list[int], conc: int) -> dict:
    finished: list[tuple[int, float, float, float]] = []  # (tokens, when it ended, its first token's seconds, its own)
    deadline = start + seconds

    async def client(http, k: int) -> None:
        i = k
        while time.time() < deadline:
            sent = time.perf_counter()
            tokens, first, _ = await one(http, base, prompts[i % len(prompts)], max_tokens)
            finished.append((tokens, time.time(), first, time.perf_counter() - sent))
            i += conc

    async with http_client(len(clients)) as http:
        await http.get(f"{base}/health")  # connection code paths warm before the clock starts
        await asyncio.sleep(max(0.0, start - time.time()))
        cpu = time.process_time()
        await asyncio.gather(*(client(http, k) for k in clients))
        return {"finished": finished, "cpu_s": time.process_time() - cpu}


if __name__ == "__main__":
    base_url, prompts_file, n_tokens, t_start, span_s, ks, n_clients, result_file = sys.argv[1:9]
    with open(prompts_file) as fh:
        loaded = json.load(fh)
    result = run(_client_process(base_url, loaded, int(n_tokens), float(t_start), float(span_s),
                                 [int(k) for k in ks.split(",")], int(n_clients)))
    Path(result_file).write_text(json.dumps(result))
