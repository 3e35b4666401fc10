"""Benchmark section ``rest``: what a user gets — the services started from their command lines (8B
shape, random bf16 weights, a random EAGLE-3 head, which accepts almost nothing: a useless head), driven
over the gateway's OpenAI REST API, streamed, at concurrency 1, 8 and 64 with 256 and 1024 new tokens
from 128-token prompts: without a drafter, with the head in the verifier (``--drafter in-process``) and
as the service pair, both under the default policy. Also: the first request after health says SERVING
against the same request once warm.

Rates are completion tokens per second over the wave (every request sent at once, from the first sent to
the last finished), the prefill included."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path

from cpu_pins import describe as pins
from models import LLAMA_8B, LLAMA_8B_SHAPE, ROOT_DIR, random_draft, target_dir, write_target_embedding, write_word_tokenizer
from paired import ci_text, detached_against_plain, paired_ratio, pass_order, versus_the_better
from rest_load import START_DELAY_S, cpu_seconds_apart, http_client, run, sustained, wave
from service_pair import stop_processes
from spy import finish as finish_spy, start as start_spy
from stack_log import EVENTS, since, tagged

CONCURRENCY = tuple(int(c) for c in os.environ.get("TANDEM_BENCH_REST_CONCURRENCY", "1,8,64").split(","))
NEW_TOKENS = (256, 1024)
SPEC_FLAGS = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


@contextlib.contextmanager
def _stack(tdir, draft, mode: str, device: str = "cuda", dtype: str = "bfloat16", verifier_flags=("--load-format", "random")):
    """Verifier (+ drafter for "pair") + gateway as processes; yields the gateway's base URL, the seconds
    the verifier took to say SERVING and the services' process ids by name."""
    from tandem.service_probe import free_port, wait_serving

    # "+si": the verifier's GIL switch interval 0.5 ms (Python's: 5 ms); "+old": the verifier of the tree in
    # TANDEM_BENCH_OLD_TREE (an earlier commit's files: its code first on the path), for A/B in one call; "+proc": the
    # verifier's engine loop in a process of its own (--engine-process, the default on a GPU), "+thread" on a thread
    # (--no-engine-process; "+si" and "+old" keep their tree's default); "+per": the gateway's generations a Generate
    # stream each (--upstream-streams per-request) instead of one GenerateMany stream; variants combine ("+proc+per")
    tag, (mode, *variants) = mode, mode.split("+")
    variant = next((v for v in variants if v != "per"), "")
    run_verifier = ([sys.executable, "-c", "import runpy, sys; sys.setswitchinterval(0.0005); "
                     "runpy.run_module('verifier', run_name='__main__', alter_sys=True)"] if variant == "si"
                    else [sys.executable, "-m", "verifier"])
    verifier_cwd = ROOT_DIR
    if variant == "old":
        verifier_cwd = os.environ.get("TANDEM_BENCH_OLD_TREE") or sys.exit(
            "a '+old' mode runs the verifier of TANDEM_BENCH_OLD_TREE (an earlier commit's files): set it")

    v_port, d_port, g_port, g_grpc = free_port(), free_port(), free_port(), free_port()
    common = ["--device", device, "--dtype", dtype]
    procs = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        if mode.startswith("pair"):
            procs.append(tagged([sys.executable, "-m", "drafter", "--model", str(draft), "--target-model", str(tdir),
                                  "--port", str(d_port), *common, *SPEC_FLAGS], f"{tag} drafter", "drafter", cwd=ROOT_DIR,
                                 env=env))
            wait_serving(d_port, 300, procs[-1], "drafter")
        verifier = [*run_verifier, "--model", str(tdir), "--port", str(v_port), *verifier_flags,
                    "--kv-pages", "12288", "--log-stats-interval", "0.5", *common]
        verifier += {"proc": ["--engine-process"], "thread": ["--no-engine-process"]}.get(variant, [])
        if mode != "target-only":  # in-process | pair, "-always": every step speculates
            verifier += ["--drafter", "in-process" if mode.startswith("in-process") else f"127.0.0.1:{d_port}",
                         "--draft-model", str(draft), *SPEC_FLAGS]
            verifier += ["--speculation-policy", "always"] if mode.endswith("-always") else []
        started = time.perf_counter()
        procs.append(tagged(verifier, tag, "verifier", cwd=verifier_cwd, env=env))
        wait_serving(v_port, 420, procs[-1], "verifier")
        ready_s = time.perf_counter() - started
        procs.append(tagged([sys.executable, "-m", "gateway", "--verifier", f"127.0.0.1:{v_port}", "--model-dir", str(tdir),
                              "--port", str(g_port), "--grpc-port", str(g_grpc), "--max-concurrent-requests", "1024",
                              "--log-level", "warning",
                              *(["--upstream-streams", "per-request"] if "per" in variants else [])],
                             f"{tag} gateway", "gateway", cwd=ROOT_DIR,
                             env=env))
        _wait_http(f"http://127.0.0.1:{g_port}/health", procs[-1])
        names = (["drafter"] if mode.startswith("pair") else []) + ["verifier", "gateway"]
        yield f"http://127.0.0.1:{g_port}", ready_s, {name: p.pid for name, p in zip(names, procs)}
    finally:
        stop_processes(procs[::-1])  # the gateway first, the drafter last


def _wait_http(url: str, proc, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with code {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


def _compare(tdir, draft, prompts: list, cells: list, modes: list[str], sustain_s: float = 0.0, repeats: int = 1,
             settle_s: float = 0.0, **stack_kw) -> dict:
    """Each mode's stack started in turn (its start-up, first and warm request times and a wave per cell
    (concurrency, new tokens): texts, and the rate unless ``sustain_s``), all kept up; then with ``sustain_s``,
    per cell, ``repeats`` closed-loop loads of that many seconds on every mode, interleaved (``pass_order``: each
    mode in every position over 2 x modes passes; the host's pace drifts by 10-20 % over minutes, and modes measured
    one after another took that drift for their difference) → per mode its rows, each beside target-only's, texts compared.
    ``settle_s``: before a cell's measured loads, each stack serves that cell unmeasured this long (a policy's verdicts
    and detached periods in place: what sustained traffic meets, where a few seconds' passes meet its first re-measures)."""
    out: dict = {}
    print(f"CPUs: {pins()}", flush=True)
    with contextlib.ExitStack() as stacks:
        up = {}
        for mode in modes:
            base, ready_s, pids = stacks.enter_context(_stack(tdir, draft, mode, **stack_kw))
            first, warm, rows = run(_waves(base, prompts, cells))
            up[mode] = base, pids
            out[mode] = {"ready_s": ready_s, "first_request_s": first["seconds"], "warm_request_s": warm["seconds"],
                         "rows": rows}
            print(f"{mode}: SERVING after {ready_s:.1f} s; first request {first['seconds']:.3f} s, warm "
                  f"{warm['seconds']:.3f} s ({first['seconds'] / warm['seconds']:.2f}x)", flush=True)
        for cell in cells:
            for mode in modes if sustain_s and settle_s else ():
                settled = sustained(up[mode][0], prompts, cell[0], cell[1], settle_s)
                print(f"  {mode:17s} concurrency {cell[0]:2d}: settled for {settle_s:.0f} s ({settled['tok_s']:.0f} tok/s, "
                      "not counted)", flush=True)
            for k in range(repeats if sustain_s else 0):
                for mode in pass_order(modes, k):
                    _sample(out[mode]["rows"][f"c{cell[0]}_n{cell[1]}"], mode, *up[mode], prompts, cell, sustain_s)
            for mode in modes:
                r = out[mode]["rows"][f"c{cell[0]}_n{cell[1]}"]
                if sustain_s:
                    r["tok_s"] = sum(x["tok_s"] for x in r["samples"]) / len(r["samples"])
                print(f"{mode:17s} concurrency {cell[0]:2d}, {cell[1]:4d} tokens: {r['tok_s']:8.1f} tok/s (TTFT "
                      f"{1e3 * r['ttft_s_mean']:.0f} ms)" + (" = mean of " + ", ".join(
                          f"{x['tok_s']:.0f}" for x in r["samples"]) if sustain_s else ""), flush=True)
    for mode in [m for m in modes if m != "target-only" and "target-only" in out]:
        for cell, r in out[mode]["rows"].items():
            base = out["target-only"]["rows"][cell]
            r["x_target_only"] = r["tok_s"] / base["tok_s"]
            r["same_text_as_target_only"] = sum(a == b for a, b in zip(r["texts"], base["texts"])) / len(r["texts"])
        print(f"{mode} / target-only: " + ", ".join(f"{c} {r['x_target_only']:.2f}x (same text "
                                                    f"{r['same_text_as_target_only']:.0%})"
                                                    for c, r in out[mode]["rows"].items()), flush=True)
    if sustain_s and repeats > 1 and "target-only" in out:
        _paired(out, modes)
    for r in (r for m in out.values() for r in m["rows"].values()):
        r.pop("texts")
    return out


def _paired(out: dict, modes: list[str]) -> None:
    """Each stack's loads against target-only's, pass by pass, and a policy stack's against the better of its
    ``-always`` twin and target-only (bench/paired.py): the host's drift between passes mostly cancels."""
    for mode in [m for m in modes if m != "target-only"]:
        for cell, r in out[mode]["rows"].items():
            samples = lambda m: [x["tok_s"] for x in out[m]["rows"][cell]["samples"]]  # noqa: E731
            r["paired_x_target_only"] = paired_ratio(samples(mode), samples("target-only"))
            line = (f"{mode:17s} {cell}: per pass {r['paired_x_target_only']['geomean']:.3f}x target-only"
                    + ci_text(r["paired_x_target_only"]))
            if f"{mode}-always" in out:
                vs = r["paired_vs_better"] = versus_the_better(samples(mode), samples(f"{mode}-always"),
                                                              samples("target-only"))
                line += (f"; {vs['geomean']:.3f} of the better of always and target-only ({vs['low']:.3f}-"
                         f"{vs['high']:.3f}){ci_text(vs)}")
                apart = r["detached_x_target_only"] = detached_against_plain(r["samples"], samples("target-only"))
                if apart is not None:
                    line += f"; its wholly detached passes {apart['geomean']:.3f}x target-only ({apart['passes']})"
            print(line, flush=True)


def _cpu_parts(pids: dict) -> dict:
    """CPU seconds by service, a verifier's engine process apart from its server ("verifier" then its gRPC front)."""
    out = {}
    for name, pid in pids.items():
        own, children = cpu_seconds_apart(pid)
        out[name] = own
        if name == "verifier" and children:
            out["engine process"] = children
        elif children:
            out[name] += children
    return out


def _sample(row: dict, mode: str, base: str, pids: dict, prompts: list, cell: tuple, sustain_s: float) -> None:
    """One closed-loop load of ``cell`` on the stack at ``base``, appended to ``row["samples"]`` with the
    services' CPU share (the wave's rate kept as ``wave_tok_s``)."""
    row.setdefault("wave_tok_s", row["tok_s"])
    cpu = _cpu_parts(pids)
    logged = EVENTS[mode].copy()
    spied = os.environ.get("TANDEM_BENCH_PYSPY")  # a folder: the verifier's threads sampled during the load (bench/spy.py)
    n = len(row.get("samples", []))
    spy = spied and start_spy(pids["verifier"], sustain_s, Path(spied) / f"{mode}-c{cell[0]}-{n}.txt", START_DELAY_S)
    r = sustained(base, prompts, cell[0], cell[1], sustain_s)
    finish_spy(spy or None)
    r["server_cpu_share"] = {name: round((used - cpu.get(name, 0.0)) / r["seconds"], 2)
                             for name, used in _cpu_parts(pids).items()}
    r["engine"] = since(mode, logged)  # (the stats windows the load spanned, one either side at most)
    row.setdefault("samples", []).append(r)
    e = r["engine"]
    compiled = f"; {e['kernels_compiled']} kernels compiled while serving" if e["kernels_compiled"] else ""
    engine = compiled if e["spec_step_share"] is None or mode == "target-only" else compiled + (
        f"; engine: {e['spec_step_share']:.0%} of steps speculative, windows detached {e['detached_share']:.0%}, "
        f"plain attached {e['attached_plain_share']:.0%}, {e['detaches']} detaches, {e['attaches']} attaches "
                f"({e['joined']} requests joined), "
        f"{e['drafts_per_round'] or 0:.1f} drafts a round, {e['rounds_per_step'] or 0:.1f} rounds a speculative step, "
        + (f"{e['overlapped_share']:.0%} of runs overlapped, " if e["overlapped_share"] is not None else "") +
        f"{e['chain_switches']} chain switches, plain steps for: "
        + (", ".join(f"{why} {n}" for why, n in sorted(e["plain_steps_for"].items(), key=lambda i: -i[1])) or "-"))
    print(f"  {mode:17s} concurrency {cell[0]:2d}: {r['tok_s']:8.1f} tok/s (a request {r['request_ms_mean']:.1f} ms, "
          f"its first token {r['ttft_ms_mean']:.1f}); CPU share: clients "
          f"{r['client_cpu_share']:.2f} (of {r['client_procs']}), "
          + ", ".join(f"{n} {c:.2f}" for n, c in r["server_cpu_share"].items())
          + (f" (the engine loop's thread {e['engine_thread_share']:.0%} of its process's)"
             if e["engine_thread_share"] is not None else "")
          # (near one CPU a process bounds the load: its CPU per token decides the rate)
          + "; µs a token: " + ", ".join(f"{n} {1e6 * c / r['tok_s']:.0f}" for n, c in r["server_cpu_share"].items()
                                         if r["tok_s"] > 0) + engine, flush=True)


async def _waves(base: str, prompts: list, cells: list) -> tuple[dict, dict, dict]:
    """On one warm client (its first request, a health check, is not timed): the first request after SERVING,
    the same request warm (best of 3), and a wave per cell → (first, warm, rows by cell)."""
    async with http_client(max(c for c, _ in cells)) as client:
        await client.get(f"{base}/health")
        first = await _collected(wave(client, base, prompts[:1], 64))
        # the same work warm: the prompt rotated, so that the prefix cache holds none of it
        p = prompts[0]
        warm = min([await _collected(wave(client, base, [p[k:] + p[:k]], 64)) for k in (1, 2, 3)],
                   key=lambda r: r["seconds"])
        rows = {f"c{conc}_n{max_tokens}": await wave(client, base, prompts[:conc], max_tokens)
                for conc, max_tokens in cells}
    return first, warm, rows


async def _collected(timed):
    """Await ``timed`` after a full collection of this process: the client is the benchmark's own process
    (torch, the sections, their results: ~180k objects, a full collection ~150 ms on a CPU core), and one
    landing inside a single timed request would be counted as the server's."""
    gc.collect()
    return await timed


def rest(ctx: dict) -> dict:
    """``TANDEM_BENCH_REST_SCHEME``: ``bf16`` (default), or ``int4`` / ``fp8``: every linear of the target but its LM
    head in that scheme (bench/sections_quant_engines.py's 8B cases)."""
    import dataclasses

    import torch

    from sections_quant_engines import llama_case

    layers = ctx.get("layers") or LLAMA_8B.num_layers
    scheme = os.environ.get("TANDEM_BENCH_REST_SCHEME", "bf16")
    tdir = (target_dir(layers) if scheme == "bf16"
            else llama_case(scheme, dataclasses.replace(LLAMA_8B, num_layers=layers)).path)
    write_word_tokenizer(tdir, LLAMA_8B_SHAPE["vocab_size"])
    write_target_embedding(tdir)
    draft = random_draft(tdir, (2, layers // 2, layers - 3))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, LLAMA_8B_SHAPE["vocab_size"], (128,), generator=g).tolist() for _ in range(64)]
    cells = [(c, m) for m in ((256,) if ctx["quick"] else NEW_TOKENS) for c in ((1, 8) if ctx["quick"] else CONCURRENCY)]
    modes = os.environ.get("TANDEM_BENCH_REST_MODES", "target-only,in-process,pair").split(",")
    return _compare(tdir, draft, prompts, cells, modes)


def rest_demo(ctx: dict) -> dict:
    """The project's trained demo pair (TANDEM_DEMO_DIR with target/ and draft/, prompts.json optional; default:
    the one shipped in the package)
    over REST: target-only, the head in the verifier under the default policy and speculating always, and
    the pair; its held-out code prompts, 120 new tokens, greedy, concurrency 1, 8, 64, each a closed-loop load
of TANDEM_BENCH_SUSTAIN_S seconds (default 8), TANDEM_BENCH_REST_REPEATS times (default 2) interleaved across the
modes, averaged; with TANDEM_BENCH_REST_SETTLE_S seconds (default 0) of unmeasured load on each stack before a cell's."""
    from pathlib import Path

    from tandem.training.demo_pair import demo_eval_prompts

    from tandem.training.demo import SHIPPED

    folder = Path(os.environ.get("TANDEM_DEMO_DIR", SHIPPED))
    tdir, draft = folder / "target", folder / "draft"
    saved = folder / "prompts.json"
    prompts = json.loads(saved.read_text()) if saved.is_file() else demo_eval_prompts(str(tdir), 64)
    prompts = (prompts * 64)[:64]
    modes = os.environ.get("TANDEM_BENCH_REST_MODES", "target-only,in-process,in-process-always,pair").split(",")
    sustain_s = float(os.environ.get("TANDEM_BENCH_SUSTAIN_S", "8"))
    settle_s = float(os.environ.get("TANDEM_BENCH_REST_SETTLE_S", "0"))
    repeats = int(os.environ.get("TANDEM_BENCH_REST_REPEATS", "2"))
    device = os.environ.get("TANDEM_BENCH_DEVICE", "cuda")  # (cpu: the stack as tandem up serves the demo there)
    return _compare(tdir, draft, prompts, [(c, 120) for c in CONCURRENCY], modes, sustain_s, repeats, settle_s,
                    verifier_flags=(), device=device, dtype="bfloat16" if device.startswith("cuda") else "float32")
