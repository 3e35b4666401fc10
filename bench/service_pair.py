"""The drafter and verifier services started as subprocesses for a benchmark, and the verifier's split
of each round into the drafter's work and the rest of the round trip (its metrics endpoint)."""

from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def service_pair(tdir, draft_dir, device: str, dtype: str, spec_flags: list[str], verifier_flags=(), drafter_flags=(),
                 drafter_profile: str | None = None):
    """``python -m drafter`` and ``python -m verifier`` (every round speculates: ``--speculation-policy
    always``) on free loopback ports; yields ``(generate(prompt, n) -> last reply, metrics port)``.
    ``drafter_profile``: run the drafter under cProfile, its stats written to this path at its exit
    (the drafter serves rounds on its main thread, which is the one cProfile sees)."""
    import subprocess
    import sys

    import grpc

    from models import ROOT_DIR
    from tandem.rpc.verifier.v1 import verifier_pb2 as pb
    from tandem.rpc.verifier.v1 import verifier_pb2_grpc as pb_grpc
    from tandem.service_probe import free_port, wait_serving

    d_port, v_port, m_port = free_port(), free_port(), free_port()
    common = ["--device", device, "--dtype", dtype, *spec_flags]
    profiler = ["-m", "cProfile", "-o", drafter_profile] if drafter_profile else []
    procs = [subprocess.Popen([sys.executable, *profiler, "-m", "drafter", "--model", str(draft_dir), "--target-model", str(tdir),
                               "--port", str(d_port), *common, *drafter_flags], cwd=ROOT_DIR)]
    try:
        wait_serving(d_port, 300, procs[0], "drafter")
        procs.append(subprocess.Popen([sys.executable, "-m", "verifier", "--model", str(tdir), "--port", str(v_port),
                                       "--drafter", f"127.0.0.1:{d_port}", "--draft-model", str(draft_dir),
                                       "--metrics-port", str(m_port), "--speculation-policy", "always", *common,
                                       *verifier_flags], cwd=ROOT_DIR))
        wait_serving(v_port, 300, procs[1], "verifier")
        time.sleep(2.0)  # the drafter connection comes up in the background
        with grpc.insecure_channel(f"127.0.0.1:{v_port}") as ch:
            stub = pb_grpc.VerifierStub(ch)

            def generate(prompt: list[int], n: int):
                req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True))
                last = None
                for last in stub.Generate(req, timeout=300):
                    pass
                return last

            yield generate, m_port
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


# (histogram, label, value): the round trip's parts, then the drafter's own split of its part.
ROUND_PARTS = (("tandem:drafter_round_seconds", "part", "drafter"), ("tandem:drafter_round_seconds", "part", "boundary"),
               ("tandem:drafter_work_seconds", "phase", "extend"), ("tandem:drafter_work_seconds", "phase", "draft"))
# The verifier's engine steps by phase (keys prefixed "step_": the drafter's phases above share names).
ENGINE_PHASES = ("draft", "verify", "accept", "draft_extend")


def round_parts_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Milliseconds per round of each part (the drafter's work, the rest of the round trip, and the
    drafter's extend and draft phases) between two scrapes."""
    rounds = max(1.0, after["count"] - before["count"])
    steps = max(1.0, after["steps"] - before["steps"])
    parts = {v: 1e3 * (after[v] - before[v]) / rounds for v in [*(v for _, _, v in ROUND_PARTS), "wait"]}
    phases = {f"step_{p}": 1e3 * (after[f"step_{p}"] - before[f"step_{p}"]) / steps for p in ENGINE_PHASES}
    return parts | phases | {"rounds": after["count"] - before["count"], "steps": after["steps"] - before["steps"]}


def round_parts(metrics_port: int) -> dict[str, float]:
    """Sums of the verifier's drafter round histograms by part and phase, and the round count."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    out = {"count": 0.0}
    for name, label, value in ROUND_PARTS:
        m = re.search(r'%s_sum\{%s="%s"\} ([0-9.eE+-]+)' % (name, label, value), text)
        out[value] = float(m.group(1)) if m else 0.0
    m = re.search(r'tandem:drafter_round_seconds_count\{part="drafter"\} ([0-9.eE+-]+)', text)
    out["count"] = float(m.group(1)) if m else 0.0
    m = re.search(r'tandem:drafter_wait_seconds_sum ([0-9.eE+-]+)', text)
    out["wait"] = float(m.group(1)) if m else 0.0
    for phase in ENGINE_PHASES:
        m = re.search(r'tandem:round_phase_seconds_sum\{phase="%s"\} ([0-9.eE+-]+)' % phase, text)
        out[f"step_{phase}"] = float(m.group(1)) if m else 0.0
    m = re.search(r'tandem:round_phase_seconds_count\{phase="verify"\} ([0-9.eE+-]+)', text)
    out["steps"] = float(m.group(1)) if m else 0.0
    return out
