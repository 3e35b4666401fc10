"""Soak the whole stack on loopback, bounded in time, with faults injected, and report what it lost.

Starts the stack as ``tandem up`` does (it *is* ``tandem up``: the launcher supervises and restarts),
then, until ``--seconds`` have passed: clients send greedy requests — REST streaming, REST
non-streaming and public gRPC, some abandoned mid-way (client disconnects) — while the drafter is
SIGKILLed ``--kill-drafter-every`` seconds after each start and the verifier is restarted once (SIGTERM: it drains,
exits, and the launcher starts it again). A request refused while the verifier restarts (503 /
UNAVAILABLE) or cut by its drain is retried until its deadline; one that never completes is *lost*.
Every completed request is checked against target-only greedy decoding by a separate in-process engine
without a drafter (*wrong* otherwise). At the end: KV pages back to their total, no /dev/shm segment
of the stack's processes left, and each process's RSS at the start and the end.

    python scripts/soak.py --seconds 45                      # tiny random pair, CPU (CI size)
    python scripts/soak.py --seconds 600 --model T --draft-model D --device cuda

Without --model it writes a tiny random target and EAGLE-3 head (the test suite's, so it needs the dev
extra). Prints one JSON report (and writes it to --json-out).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tandem.rpc.generation.v1 import generation_pb2 as gen_pb  # noqa: E402
from tandem.rpc.generation.v1 import generation_pb2_grpc as gen_grpc  # noqa: E402
from tandem.service_probe import free_port  # noqa: E402

MAX_NEW = 32
RETRYABLE_HTTP = {429, 502, 503, 504}
RETRYABLE_GRPC = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
                  grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}


def tiny_pair(folder: Path) -> tuple[str, str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import write_checkpoint
    from draft_checkpoints import make_draft
    from tandem.training.stdlib_text import train_tokenizer
    from tandem.configs.model import ModelConfig

    target = folder / "target"
    if not (target / "tokenizer.json").exists():
        write_checkpoint(target, "llama", seed=21, num_hidden_layers=6, vocab_size=512, eos_token_id=1)
        train_tokenizer(target, vocab_size=512)
        make_draft(folder / "draft", ModelConfig.from_dir(target), draft_vocab=128, seed=4)
    return str(target), str(folder / "draft")


def references(target: str, prompts: list[list[int]], device: str, dtype: str) -> list[list[int]]:
    """Target-only greedy continuations (ignore_eos), MAX_NEW tokens each: a request for k tokens must
    return the first k (greedy decoding does not depend on the length asked for). On the stack's device and
    dtype: greedy identity is a float32 property, and CPU and GPU float32 may still part at a near-tie."""
    import torch

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.sampling import SamplingParams

    import gc

    cfg = EngineConfig(model=target, device=device, dtype=dtype, kv_pages=64 * len(prompts))  # (not sized from memory)
    with LLMEngine(cfg) as engine:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    del engine  # (the engine holds itself in a cycle: collected, then its memory handed back)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the stack's processes size their pools from the memory left free
    return [o.output_token_ids for o in outs]


class Stack:
    """``tandem up`` as a subprocess, and its children found through /proc."""

    def __init__(self, args, target: str, draft: str, log_path: Path):
        self.ports = {k: free_port() for k in ("http", "grpc", "verifier", "drafter", "metrics")}
        argv = [sys.executable, "-m", "tandem.cli", "up", "--model", target, "--draft-model", draft, "--device",
                args.device, "--port", str(self.ports["http"]), "--grpc-port", str(self.ports["grpc"]),
                "--verifier-port", str(self.ports["verifier"]), "--drafter-port", str(self.ports["drafter"]),
                "--metrics-port", str(self.ports["metrics"]), "--speculation-policy", "always", "--dtype", args.dtype]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("OMP_NUM_THREADS", "1")  # three processes share the cores
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.pids_seen: set[int] = {self.proc.pid}

    def wait_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem up exited with {self.proc.returncode}")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.ports['http']}/health", timeout=2).status == 200:
                    if self.child("drafter") and self.child("verifier"):
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError("the stack did not come up")

    def child(self, role: str) -> int | None:
        children = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                children += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                pass
        for pid in children:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"-m" in argv and argv[argv.index(b"-m") + 1] == role.encode():
                self.pids_seen.add(pid)
                return pid
        return None

    def restarts(self) -> dict[str, int]:
        """The restarts the launcher made so far, by role (it logs each as it starts the service again)."""
        log = self.log_path.read_text(errors="replace")
        return {role: log.count(f"restarting {role} (") for role in ("drafter", "verifier", "gateway")}

    def wait_restarts(self, owed: dict[str, int], timeout_s: float) -> float:
        """Wait, at most ``timeout_s``, until the launcher restarted each role at least ``owed[role]`` times;
        returns the seconds waited. A killed service comes back after its back-off, which doubles with each
        exit in a row (the drafter killed again and again: 0.5, 1, 2, 4 s ...), and the launcher sees the exit
        at its next poll: the last kill's restart may still be pending when the clients stop, later still on a
        busy machine."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s and self.proc.poll() is None:
            done = self.restarts()
            if all(done[role] >= n for role, n in owed.items()):
                break
            time.sleep(0.1)
        return round(time.monotonic() - started, 2)

    def rss_mb(self) -> dict[str, dict]:
        out = {}
        for role in ("drafter", "verifier", "gateway"):
            pid = self.child(role)
            try:
                kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if line.startswith("VmRSS:"))
                out[role] = {"pid": pid, "rss_mb": round(kb / 1024, 1)}
            except (OSError, StopIteration, TypeError):
                out[role] = {"pid": pid, "rss_mb": None}
        return out

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.ports['metrics']}/metrics", timeout=5).read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                name = re.sub(r',?model_name="[^"]*"', "", name).replace("{,", "{").replace("{}", "")
                try:
                    values[name] = float(value)
                except ValueError:
                    pass
        return values

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


class Soak:
    def __init__(self, args, stack: Stack, prompts, refs, ref_texts, model_name: str):
        """``refs[i]``: prompt i's reference tokens; ``ref_texts[i][k]``: the text of its first k."""
        self.args, self.stack, self.prompts, self.model = args, stack, prompts, model_name
        self.refs, self.ref_texts = refs, ref_texts
        # every request sent ("submitted") ends served, cancelled (the client went away), lost or wrong
        self.counts = {"submitted": 0, "served": 0, "cancelled": 0, "lost": 0, "wrong": 0, "retries": 0}
        self.by_kind: dict[str, int] = {}
        self.faults = {"drafter_sigkill": 0, "verifier_restart": 0, "client_disconnect": 0}
        self.lock = threading.Lock()
        self.stop_at = time.monotonic() + args.seconds
        self.failures: list[str] = []

    def done(self) -> bool:
        """--seconds have passed and at least --min-requests were sent and --min-drafter-kills made: the soak's
        size is a count as well as a time, so that a slow machine runs longer instead of doing less."""
        with self.lock:
            return (time.monotonic() >= self.stop_at and self.counts["submitted"] >= self.args.min_requests
                    and self.faults["drafter_sigkill"] >= self.args.min_drafter_kills)

    def count(self, key: str, kind: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if kind is not None:
                self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    # -- clients ---------------------------------------------------------------------------------
    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.done():
            i, k = rng.randrange(len(self.prompts)), rng.randint(4, MAX_NEW)
            kind = rng.choice(["rest", "rest_stream", "grpc"])
            disconnect = rng.random() < self.args.disconnect_rate
            self.one(kind, i, k, disconnect, rng)

    def one(self, kind: str, i: int, k: int, disconnect: bool, rng: random.Random) -> None:
        self.count("submitted")
        deadline = time.monotonic() + self.args.request_deadline_s
        while True:
            try:
                result = getattr(self, kind)(self.prompts[i], k, disconnect, rng)
            except Retry as e:
                if time.monotonic() > deadline:
                    self.count("lost")
                    self.failures.append(f"lost {kind} prompt {i}: {e}")
                    return
                self.count("retries")
                time.sleep(0.2)
                continue
            if result is None:  # the client went away on purpose
                with self.lock:
                    self.faults["client_disconnect"] += 1
                self.count("cancelled")
            else:
                expected = self.ref_texts[i][k] if isinstance(result, str) else self.refs[i][:k]  # REST: text
                if result == expected:
                    self.count("served", kind)
                else:
                    self.count("wrong")
                    self.failures.append(f"wrong {kind} prompt {i} ({k} tokens): {result!r} != {expected!r}")
            return

    def body(self, prompt, k: int, stream: bool) -> bytes:
        return json.dumps({"model": self.model, "prompt": prompt, "max_tokens": k, "temperature": 0,
                           "ignore_eos": True, "stream": stream}).encode()

    def rest(self, prompt, k, disconnect, rng):
        conn = http.client.HTTPConnection("127.0.0.1", self.stack.ports["http"],
                                          timeout=rng.uniform(0.02, 0.3) if disconnect else 120)
        try:
            conn.request("POST", "/v1/completions", self.body(prompt, k, False), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except TimeoutError:
            return None if disconnect else _raise(Retry("timed out"))
        except (ConnectionError, http.client.HTTPException) as e:
            raise Retry(f"{type(e).__name__}: {e}") from None
        finally:
            conn.close()
        if resp.status in RETRYABLE_HTTP:
            raise Retry(f"HTTP {resp.status}")
        if resp.status != 200:
            return [f"HTTP {resp.status}: {data[:200]!r}"]
        doc = json.loads(data)
        return self.tokens_of(doc["choices"][0]["text"], doc["usage"]["completion_tokens"], k)

    def rest_stream(self, prompt, k, disconnect, rng):
        conn = http.client.HTTPConnection("127.0.0.1", self.stack.ports["http"], timeout=120)
        text, chunks, finished = "", 0, False
        try:
            conn.request("POST", "/v1/completions", self.body(prompt, k, True), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status in RETRYABLE_HTTP:
                raise Retry(f"HTTP {resp.status}")
            if resp.status != 200:
                return [f"HTTP {resp.status}: {resp.read()[:200]!r}"]
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[5:])
                if "error" in doc:
                    raise Retry(f"stream error: {doc['error']}")
                choice = doc["choices"][0]
                text += choice.get("text", "")
                chunks += 1
                finished = finished or bool(choice.get("finish_reason"))
                if disconnect and chunks >= rng.randint(1, 3):
                    return None  # closing the connection mid-stream
        except (ConnectionError, http.client.HTTPException, TimeoutError) as e:
            raise Retry(f"{type(e).__name__}: {e}") from None
        finally:
            conn.close()
        if not finished:
            raise Retry("the stream ended without a finish reason")
        return self.tokens_of(text, None, k)

    def grpc(self, prompt, k, disconnect, rng):
        with grpc.insecure_channel(f"127.0.0.1:{self.stack.ports['grpc']}") as channel:
            call = gen_grpc.GenerationStub(channel).Generate(gen_pb.GenerateRequest(
                model=self.model, token_ids=gen_pb.TokenIds(ids=prompt), max_tokens=k, temperature=0.0,
                ignore_eos=True), timeout=120)
            tokens, last = [], None
            try:
                for last in call:
                    tokens += last.token_ids
                    if disconnect and len(tokens) >= 2:
                        call.cancel()
                        return None
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED and disconnect:
                    return None
                if e.code() in RETRYABLE_GRPC:
                    raise Retry(f"{e.code().name}: {e.details()}") from None
                return [f"{e.code().name}: {e.details()}"]
            if last is None or not last.finish_reason:
                raise Retry("the stream ended without a finish reason")
            return tokens

    def tokens_of(self, text: str, completion_tokens, k: int):
        """REST answers in text: it is right when it is the reference's text (and, when told, length)."""
        if completion_tokens is not None and completion_tokens != k:
            return [f"completion_tokens {completion_tokens} != {k}"]
        return text

    # -- faults ----------------------------------------------------------------------------------
    def faults_loop(self) -> None:
        started = time.monotonic()
        restart_at = started + self.args.seconds * self.args.verifier_restart_at
        drafter, up_since, killed = None, None, set()  # the drafter's process, since when it serves
        while not self.done():
            now = time.monotonic()
            if restart_at is not None and now >= restart_at:
                pid = self.stack.child("verifier")
                if pid:
                    os.kill(pid, signal.SIGTERM)
                    self.faults["verifier_restart"] += 1
                    restart_at = None
            pid = self.stack.child("drafter")
            pid = None if pid in killed else pid  # (the launcher has not noticed yet)
            if pid != drafter:  # a new incarnation (the launcher restarted it): its own time to run
                drafter, up_since = pid, None
            if pid and up_since is None and _accepts(self.stack.ports["drafter"]):
                up_since = now  # serving (it listens once loaded: on a GPU ~10 s after its start)
            # Each incarnation serves --kill-drafter-every seconds before its kill, so that the verifier
            # reconnects and speculates between kills however long the launcher's back-off or the load takes.
            if pid and up_since is not None and now - up_since >= self.args.kill_drafter_every:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    self.faults["drafter_sigkill"] += 1
                killed.add(pid)
            time.sleep(0.1)


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


class Retry(Exception):
    pass


def _raise(e: Exception):
    raise e


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=45.0, help="how long requests are sent (faults included)")
    p.add_argument("--model", default=None, help="target folder with a tokenizer (default: a tiny random pair)")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="the stack's and the reference's (greedy identity holds in float32)")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--disconnect-rate", type=float, default=0.15)
    p.add_argument("--kill-drafter-every", type=float, default=6.0)
    p.add_argument("--verifier-restart-at", type=float, default=0.4, help="fraction of --seconds (once)")
    p.add_argument("--min-requests", type=int, default=0,
                   help="keep sending past --seconds until this many requests were sent")
    p.add_argument("--min-drafter-kills", type=int, default=0,
                   help="keep going past --seconds until the drafter was SIGKILLed this many times")
    p.add_argument("--request-deadline-s", type=float, default=90.0, help="a request is lost once retried this long")
    p.add_argument("--workdir", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="tandem-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    target, draft = (args.model, args.draft_model) if args.model else tiny_pair(work / "models")
    from tandem.tokenizer import TextTokenizer

    tok = TextTokenizer(target)
    rng = random.Random(args.seed)
    source = Path(os.__file__).read_text()
    prompts = [tok.encode(source[(o := rng.randrange(len(source) - 400)): o + rng.randint(20, 200)],
                          add_special_tokens=False)[:48] or [5]
               for _ in range(args.prompts)]
    refs = references(target, prompts, args.device, args.dtype)
    ref_texts = [[tok.decode(r[:k]) for k in range(MAX_NEW + 1)] for r in refs]

    shm_before = {e.name for e in Path("/dev/shm").iterdir()}
    stack = Stack(args, target, draft, work / "stack.log")
    report: dict = {"command": "python scripts/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": f"{os.cpu_count()} CPUs, {args.device}"}
    try:
        stack.wait_up(600)
        model = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{stack.ports['http']}/v1/models",
                                                  timeout=10).read())["data"][0]["id"]
        soak = Soak(args, stack, prompts, refs, ref_texts, model)
        soak.one("grpc", 0, 4, False, rng)  # warm-up
        report["rss_start"] = stack.rss_mb()
        threads = [threading.Thread(target=soak.worker, args=(args.seed * 100 + c,)) for c in range(args.clients)]
        threads.append(threading.Thread(target=soak.faults_loop))
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        # Every service killed is owed a restart: counted once it happened, not at whichever moment the soak
        # ended (a restart that does not come within the bound stays missing from launcher_restarts).
        report["restarts_waited_s"] = stack.wait_restarts(
            {"drafter": soak.faults["drafter_sigkill"], "verifier": soak.faults["verifier_restart"]}, timeout_s=60)
        report["rss_end"] = stack.rss_mb()
        kv = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = stack.metrics()
            kv = {"free": m.get("tandem:kv_pages_free"), "total": m.get("tandem:kv_pages_capacity"),
                  "running": m.get("tandem:num_requests_running"), "waiting": m.get("tandem:num_requests_waiting")}
            if kv["free"] == kv["total"] and not kv["running"] and not kv["waiting"]:
                break
            time.sleep(0.5)
        report["kv_pages"] = {**kv, "back_to_total": kv["free"] == kv["total"]}
        report["speculation_since_verifier_restart"] = {  # the verifier's counters start again at its restart
            "drafts": m.get("tandem:spec_decode_num_drafts_total"),
            "drafter_losses": m.get("tandem:drafter_failures_total")}
        report.update(requests=soak.counts, served_by_kind=soak.by_kind, faults=soak.faults,
                      failures=soak.failures[:20])
    finally:
        report["stack_exit_code"] = stack.stop()
        stack.log.close()
        log = (work / "stack.log").read_text(errors="replace")
        if sys.exc_info()[0] is not None:  # the soak failed: what the stack said last
            print(log[-6000:], file=sys.stderr)
        report["launcher_restarts"] = stack.restarts()
    pids = {str(pid) for pid in stack.pids_seen}

    def shm_left() -> list[str]:
        return sorted(e.name for e in Path("/dev/shm").iterdir()
                      if e.name not in shm_before and (e.name.startswith("tandem-") or e.name.startswith("torch_"))
                      and any(part in pids for part in e.name.split("-") + e.name.split("_")))

    # The watchdogs of killed owners unlink within ~50 ms of the death (later on a busy machine): polled, bounded.
    deadline = time.monotonic() + 15
    while (left := shm_left()) and time.monotonic() < deadline:
        time.sleep(0.1)
    report["shm_left"] = left
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    ok = (report.get("requests", {}).get("lost", 1) == 0 and report.get("requests", {}).get("wrong", 1) == 0
          and report.get("kv_pages", {}).get("back_to_total") and not left)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
