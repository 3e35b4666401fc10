"""The drafter and verifier services started as subprocesses for a benchmark, and the verifier's split
of each round into the drafter's work and the rest of the round trip (its metrics endpoint)."""

from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def service_pair(tdir, draft_dir, device: str, dtype: str, spec_flags: list[str], verifier_flags=(), drafter_flags=(),
                 head_in_verifier: bool = False):
    """``python -m drafter`` and ``python -m verifier`` (every round speculates: ``--speculation-policy
    always``) on free loopback ports; yields ``(generate(prompt, n) -> last reply, metrics port)``.
    ``head_in_verifier``: no drafter service, the verifier runs the head itself (``--drafter in-process``)."""
    import subprocess
    import sys

    import grpc

    from models import ROOT_DIR
    from tandem import internal_secret
    from tandem.rpc.verifier.v1 import verifier_pb2 as pb
    from tandem.rpc.verifier.v1 import verifier_pb2_grpc as pb_grpc
    from tandem.service_probe import free_port, wait_serving

    d_port, v_port, m_port = free_port(), free_port(), free_port()
    common = ["--device", device, "--dtype", dtype, *spec_flags]
    procs = []
    try:
        if not head_in_verifier:
            procs.append(subprocess.Popen([sys.executable, "-m", "drafter", "--model", str(draft_dir), "--target-model",
                                           str(tdir), "--port", str(d_port), *common, *drafter_flags], cwd=ROOT_DIR))
            wait_serving(d_port, 300, procs[0], "drafter")
        drafter = "in-process" if head_in_verifier else f"127.0.0.1:{d_port}"
        procs.append(subprocess.Popen([sys.executable, "-m", "verifier", "--model", str(tdir), "--port", str(v_port),
                                       "--drafter", drafter, "--draft-model", str(draft_dir),
                                       "--metrics-port", str(m_port), "--speculation-policy", "always", *common,
                                       *verifier_flags], cwd=ROOT_DIR))
        wait_serving(v_port, 300, procs[-1], "verifier")
        time.sleep(2.0)  # the drafter connection comes up in the background
        with grpc.insecure_channel(f"127.0.0.1:{v_port}") as ch:
            stub = pb_grpc.VerifierStub(ch)
            auth = internal_secret.metadata(internal_secret.load())  # (the verifier's, from the environment it inherits)

            def generate(prompt: list[int], n: int):
                req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True))
                last = None
                for last in stub.Generate(req, timeout=300, metadata=auth):
                    pass
                return last

            yield generate, m_port
    finally:
        stop_processes(procs)


def stop_processes(procs: list) -> None:
    """SIGTERM each service (they drain), then wait; kill what has not exited after a minute."""
    import subprocess

    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


# The verifier's engine steps by phase (keys prefixed "step_": the drafter's phases share names).
ENGINE_PHASES = ("draft", "verify", "accept", "draft_extend")
# name in the result -> the verifier's Prometheus sample (a sum); "rounds" and "direct" count them.
SUMS = {"extend": 'tandem:drafter_work_seconds_sum{phase="extend"}',  # every round: the drafter's report
        "draft": 'tandem:drafter_work_seconds_sum{phase="draft"}',
        "wait": "tandem:drafter_wait_seconds_sum",  # every round: the engine blocked for the reply
        "boundary": 'tandem:drafter_round_seconds_sum{part="boundary"}',  # rounds sent and awaited in one go
        "rounds": 'tandem:drafter_work_seconds_count{phase="extend"}',
        "direct": 'tandem:drafter_round_seconds_count{part="drafter"}',
        "steps": 'tandem:round_phase_seconds_count{phase="verify"}',
        "chain_runs": 'tandem:drafter_rounds_total{kind="chain_run"}',  # runs queued on the device with the drafter
        **{f"step_{p}": f'tandem:round_phase_seconds_sum{{phase="{p}"}}' for p in ENGINE_PHASES}}


def round_parts_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per round between two scrapes (ms): the drafter's work (``drafter`` = its ``extend`` + ``draft``)
    and the engine's ``wait`` over every round; the rest of the round trip (``boundary``) over the rounds
    sent and awaited in one go (NaN when every round was prefetched: its trip then holds the engine's
    own work); the engine phases per step."""
    d = {k: after[k] - before[k] for k in SUMS}
    rounds, direct, steps = max(1.0, d["rounds"]), d["direct"], max(1.0, d["steps"])
    out = {k: 1e3 * d[k] / rounds for k in ("extend", "draft", "wait")}
    out["drafter"] = out["extend"] + out["draft"]
    out["boundary"] = 1e3 * d["boundary"] / direct if direct else float("nan")
    out |= {f"step_{p}": 1e3 * d[f"step_{p}"] / steps for p in ENGINE_PHASES}
    return out | {"rounds": d["rounds"], "direct_rounds": direct, "steps": d["steps"], "chain_runs": d["chain_runs"]}


def round_parts(metrics_port: int) -> dict[str, float]:
    """The verifier's sums and counts named in SUMS (0 for a sample not yet exported)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        samples[name] = value
    return {k: float(samples.get(sample, 0.0)) for k, sample in SUMS.items()}
