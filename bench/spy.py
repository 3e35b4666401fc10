"""Where a served verifier's threads spend their time: py-spy samples the verifier (and its engine process, where the
engine runs in one) during each REST load
(``TANDEM_BENCH_PYSPY=DIR``: bench/sections_rest.py; the py-spy wheel is carried by scripts/fetch_gpu_wheels.sh),
one raw folded-stack file a load, ``DIR/<mode>-c<concurrency>-<pass>.txt``; this folds them by stack and thread.

    python3 bench/spy.py DIR            each stack's busiest functions per thread, summed over its loads by concurrency,
                                        a policy stack against its ``-always`` twin, and every stack against
                                        target-only (shares of the engine's samples, inclusive and self)
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

RATE_HZ = 250
_PROCESS = re.compile(r"(?:^|;)process (\d+):")
_FRAME = re.compile(r"^(?P<name>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def start(pid: int, seconds: float, path: Path, delay_s: float = 0.0) -> subprocess.Popen | None:
    """py-spy recording ``pid``'s threads (idle samples included: a thread waiting on the GPU or the GIL is where its
    time goes) for ``seconds`` from ``delay_s`` on (a load's clients start that late) into ``path``; None where py-spy
    is not installed."""
    # (gpu_check.sh installs the carried wheels with --target: the binary lands in a bin/ beside the packages)
    beside = (Path(entry) / "bin" / "py-spy" for entry in sys.path)
    spy = shutil.which("py-spy") or next((str(p) for p in beside if p.is_file()), None)
    if spy is None:
        print("TANDEM_BENCH_PYSPY: py-spy not found", flush=True)
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(["sh", "-c", f'sleep {delay_s}; exec "$0" "$@"', spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate",
                             str(RATE_HZ), "--format", "raw", "--threads", "--idle", "--nonblocking", "--subprocesses", "--output",
                             str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    if proc.returncode:
        print(f"py-spy exited {proc.returncode}: {err.strip()[-300:]}", flush=True)


def _stacks(path: Path):
    """(thread, [function names, root first], samples) per line of a raw py-spy file."""
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # --subprocesses: the chain of processes down to the sampled one comes first (a command line may hold ";"),
        # then the thread; the sampled process's id goes into the thread's name
        at = next((i for i, f in enumerate(frames) if f.startswith("thread (")), 0)
        if at:
            pids = _PROCESS.findall(";".join(frames[:at]))
            frames = [f"process {pids[-1]} {frames[at]}" if pids else frames[at], *frames[at + 1:]]
        names = []
        for frame in frames[1:]:
            m = _FRAME.match(frame)
            names.append(f"{m['name']} ({Path(m['file']).name})" if m else frame)
        yield frames[0], names, int(count)


def fold(paths: list[Path]) -> dict:
    """Per thread kind (the engine's: its stacks reach llm_engine.py; the others by their root function):
    samples, and per function its inclusive and self samples."""
    kinds: dict = collections.defaultdict(lambda: {"samples": 0, "inclusive": collections.Counter(),
                                                   "self": collections.Counter()})
    threads: dict = collections.defaultdict(list)
    for path in paths:
        for thread, names, n in _stacks(path):
            threads[(path, thread)].append((names, n))
    for stacks in threads.values():
        engine = any("(llm_engine.py)" in name for names, _ in stacks for name in names)
        kind = "engine" if engine else (stacks[0][0][0] if stacks[0][0] else "?")
        k = kinds[kind]
        for names, n in stacks:
            k["samples"] += n
            for name in set(names):
                k["inclusive"][name] += n
            if names:
                k["self"][names[-1]] += n
    return kinds


def _shares(counter: collections.Counter, total: int) -> dict:
    return {name: n / total for name, n in counter.items()} if total else {}


def main(folder: str) -> None:
    groups = collections.defaultdict(list)
    for path in sorted(Path(folder).glob("*.txt")):
        mode, _, rest = path.stem.rpartition("-c")
        groups[(mode, rest.split("-")[0])].append(path)
    folded = {key: fold(paths) for key, paths in groups.items()}
    for (mode, conc), kinds in sorted(folded.items()):
        print(f"=== {mode}, concurrency {conc}: " + ", ".join(f"{kind} {k['samples']}" for kind, k in kinds.items()))
        e = kinds.get("engine")
        if e is None:
            continue
        for what in ("inclusive", "self"):
            top = sorted(_shares(e[what], e["samples"]).items(), key=lambda i: -i[1])[:30]
            print(f"  engine thread, {what}: " + "; ".join(f"{100 * s:.1f}% {name}" for name, s in top))
    for (mode, conc), kinds in sorted(folded.items()):
        # a policy stack against its -always twin, and every stack with a drafter against target-only (where the
        # engine thread is busy throughout, a share that grows is host time a token that grew)
        for other in (f"{mode}-always", "target-only"):
            twin = folded.get((other, conc))
            if other == mode or twin is None or "engine" not in kinds or "engine" not in twin:
                continue
            a, b = kinds["engine"], twin["engine"]
            for what in ("inclusive", "self"):
                mine, theirs = _shares(a[what], a["samples"]), _shares(b[what], b["samples"])
                diff = sorted(((mine.get(n, 0) - theirs.get(n, 0), n) for n in set(mine) | set(theirs)),
                              key=lambda d: -abs(d[0]))
                print(f"=== {mode} against {other} at concurrency {conc} ({what} share of the engine thread, points): "
                      + "; ".join(f"{100 * d:+.1f} {n}" for d, n in diff[:30] if abs(d) >= 0.005))


if __name__ == "__main__":
    main(sys.argv[1])
