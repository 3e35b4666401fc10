"""The drafter and verifier services started as subprocesses for a benchmark, and the verifier's split
of each round into the drafter's work and the rest of the round trip (its metrics endpoint)."""

from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def service_pair(tdir, draft_dir, device: str, dtype: str, spec_flags: list[str], verifier_flags=(), drafter_flags=()):
    """``python -m drafter`` and ``python -m verifier`` (every round speculates: ``--speculation-policy
    always``) on free loopback ports; yields ``(generate(prompt, n) -> last reply, metrics port)``."""
    import subprocess
    import sys

    import grpc

    from models import ROOT_DIR
    from tandem.rpc.verifier.v1 import verifier_pb2 as pb
    from tandem.rpc.verifier.v1 import verifier_pb2_grpc as pb_grpc
    from tandem.service_probe import free_port, wait_serving

    d_port, v_port, m_port = free_port(), free_port(), free_port()
    common = ["--device", device, "--dtype", dtype, *spec_flags]
    procs = [subprocess.Popen([sys.executable, "-m", "drafter", "--model", str(draft_dir), "--target-model", str(tdir),
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


def round_parts_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Milliseconds per round of the drafter's work and of the rest of the round trip between two scrapes."""
    rounds = max(1.0, after["count"] - before["count"])
    return {k: 1e3 * (after[k] - before[k]) / rounds for k in ("drafter", "boundary")} | {"rounds": after["count"] - before["count"]}


def round_parts(metrics_port: int) -> dict[str, float]:
    """Sums of the verifier's tandem:drafter_round_seconds histogram by part, and the round count."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    out = {"drafter": 0.0, "boundary": 0.0, "count": 0.0}
    for part in ("drafter", "boundary"):
        m = re.search(r'tandem:drafter_round_seconds_sum\{part="%s"\} ([0-9.eE+-]+)' % part, text)
        out[part] = float(m.group(1)) if m else 0.0
    m = re.search(r'tandem:drafter_round_seconds_count\{part="drafter"\} ([0-9.eE+-]+)', text)
    out["count"] = float(m.group(1)) if m else 0.0
    return out
