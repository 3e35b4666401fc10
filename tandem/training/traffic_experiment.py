"""Retrain the demo head from served traffic, end to end, and compare it with the shipped head.

1. Serve: start the real drafter and verifier (``--capture-traffic``) on the demo pair and send the
   demo recipe's training prompts through the verifier's gRPC API, several at a time (greedy, the
   recipe's response length). The verifier writes every finished request to the traffic folder.
2. Train: ``drafter.train`` on that folder alone (stored features, no target forward for training),
   with the demo recipe's settings.
3. Evaluate both heads on the same held-out prompts (accept length at T=0 and T=1).

    python -m tandem.training.traffic_experiment --out DIR [--prompts N] [--concurrency C]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tandem.service_probe import free_port, wait_serving
from tandem.training.progress import Progress, note


def serve_and_capture(target: str, draft: str, prompts: list[list[int]], traffic: Path, new_tokens: int,
                      concurrency: int) -> dict:
    """Run the prompts through the drafter + verifier pair with capture on; → serving stats."""
    import grpc

    from tandem import internal_secret
    from tandem.rpc.verifier.v1 import verifier_pb2 as pb
    from tandem.rpc.verifier.v1 import verifier_pb2_grpc as pb_grpc

    d_port, v_port = free_port(), free_port()
    py = [sys.executable, "-m"]
    drafter = subprocess.Popen(py + ["drafter", "--model", draft, "--target-model", target, "--port", str(d_port)])
    verifier = None
    try:
        wait_serving(d_port, 600, drafter, "drafter")
        verifier = subprocess.Popen(py + ["verifier", "--model", target, "--port", str(v_port), "--drafter",
                                          f"127.0.0.1:{d_port}", "--draft-model", draft, "--capture-traffic", str(traffic)])
        wait_serving(v_port, 600, verifier, "verifier")
        bar = Progress("serve", len(prompts))
        done = tokens = 0
        started = time.perf_counter()
        with grpc.insecure_channel(f"127.0.0.1:{v_port}") as channel:
            stub = pb_grpc.VerifierStub(channel)
            auth = internal_secret.metadata(internal_secret.load())  # (the verifier's, from the environment it inherits)

            def one(prompt: list[int]) -> int:
                request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_new_tokens=new_tokens))
                return sum(len(m.token_ids) for m in stub.Generate(request, timeout=600, metadata=auth))

            with ThreadPoolExecutor(concurrency) as pool:
                for n in pool.map(one, prompts):
                    done, tokens = done + 1, tokens + n
                    bar.update(done, n)
        bar.close()
        seconds = time.perf_counter() - started
    finally:
        for proc in (verifier, drafter):  # SIGTERM: the verifier writes its last shard before exiting
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(120)
    return {"requests": done, "tokens": tokens, "seconds": round(seconds, 1), "tokens_per_s": tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.training.traffic_experiment", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="work folder: traffic/, head/ and report.json")
    p.add_argument("--prompts", type=int, default=None, help="training prompts to serve (default: the recipe's)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from tandem.training.demo import ensure_demo_draft, ensure_demo_target
    from tandem.training import demo_pair
    from tandem.training.data import Sample
    from tandem.training.evaluate import EvalConfig, evaluate_pair
    from tandem.training.pipeline import run_job

    target, shipped = str(ensure_demo_target()), str(ensure_demo_draft())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    traffic = out / "traffic"
    report: dict = {}
    prompts = demo_pair.demo_train_prompts(target, args.prompts or demo_pair.DRAFT_PROMPTS)
    if not (traffic / "dataset.json").is_file():
        note(f"serving {len(prompts)} prompts through drafter + verifier with --capture-traffic {traffic}")
        report["serving"] = serve_and_capture(target, shipped, prompts, traffic, demo_pair.RESPONSE_TOKENS,
                                              args.concurrency)
    job = dataclasses.replace(demo_pair.demo_draft_job(target, out / "head", out / "head.run"), traffic=(str(traffic),))
    eval_prompts = demo_pair.demo_eval_prompts(target)
    report["training"] = run_job(job, eval_samples=[Sample(tuple(q)) for q in eval_prompts], resume=True)
    cfg = EvalConfig(speed_prompts=0)
    report["eval_retrained"] = evaluate_pair(target, str(out / "head"), eval_prompts, cfg)
    report["eval_shipped"] = evaluate_pair(target, shipped, eval_prompts, cfg)
    for name in ("shipped", "retrained"):
        by_t = report[f"eval_{name}"]["by_temperature"]
        note(f"{name:9s} head: accept length T=0 {by_t['0']['accept_length_mean']:.3f}, "
             f"T=1 {by_t['1']['accept_length_mean']:.3f} on {len(eval_prompts)} held-out prompts")
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
