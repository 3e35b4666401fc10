"""Data-size sweep: train the EAGLE-3 head on 1/8, 1/4, 1/2 and all of the training samples and
report held-out draft loss, accuracy and accept length per size (EAGLE-3's scaling result:
acceptance keeps rising with the volume of target features the head is trained on).

``python -m tandem.training.sweep`` uses the demo pair's samples (the target's own completions of
stdlib prompts, cached by the demo draft build) and recipe; every size trains for the same number of
epochs, so larger sizes also get proportionally more steps (``--same-steps``: all sizes get the steps
of the full size, isolating data diversity from compute). Results: a markdown table on stdout and
``OUT/sweep.json``; finished sizes are reused when the sweep is run again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tandem.training.progress import note


def sweep(target_dir: str, samples, eval_samples, fractions: list[float], work: Path, same_steps: bool = False,
          threads: int | None = None) -> list[dict]:
    from tandem.training.demo_pair import DEMO_DRAFT, demo_draft_job
    from tandem.training.evaluate import EvalConfig
    from tandem.training.pipeline import run_job

    full_steps = DEMO_DRAFT.total_steps(len(samples))
    rows = []
    for fraction in fractions:
        n = max(DEMO_DRAFT.batch_size, round(len(samples) * fraction))
        out = work / f"draft_{n}"
        result_file = out / "training.json"
        if result_file.is_file():
            note(f"sweep: reusing {out}")
            summary = json.loads(result_file.read_text())
        else:
            note(f"sweep: training on {n} of {len(samples)} samples ({fraction:g})")
            train = dataclasses.replace(DEMO_DRAFT, max_steps=full_steps) if same_steps else DEMO_DRAFT
            job = dataclasses.replace(demo_draft_job(target_dir, out, train=train),
                                      eval=EvalConfig(temperatures=(0.0, 1.0), speed_prompts=0))
            # samples are in random order (seeded prompt sampling), so a prefix is a random subset
            summary = run_job(job, samples[:n], eval_samples)
        held, ev = summary["heldout"], summary["eval"]["by_temperature"]
        rows.append({
            "fraction": fraction, "samples": n, "train_tokens": summary["train_tokens"], "steps": summary["steps"],
            "heldout_loss": held["loss_weighted"], "heldout_loss_step0": held["loss_by_step"][0],
            "heldout_acc": held["acc_by_step"], "accept_length_t0": ev["0"]["accept_length_mean"],
            "accept_length_t1": ev["1"]["accept_length_mean"], "acceptance_by_position_t0": ev["0"]["acceptance_by_position"],
        })
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| data | samples | train tokens | steps | held-out draft loss (Σ 0.8^k·L_k) | step-0 loss | "
             "acc step 0 / last | accept length T=0 | accept length T=1 | acceptance by position (T=0) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pos = " ".join(f"{a:.2f}" for a in r["acceptance_by_position_t0"])
        lines.append(f"| {r['fraction']:g} | {r['samples']} | {r['train_tokens']:,} | {r['steps']} | {r['heldout_loss']:.3f} | "
                     f"{r['heldout_loss_step0']:.3f} | {r['heldout_acc'][0]:.3f} / {r['heldout_acc'][-1]:.3f} | "
                     f"{r['accept_length_t0']:.3f} | {r['accept_length_t1']:.3f} | {pos} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.training.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="work folder (default: the demo cache's sweep/)")
    p.add_argument("--fractions", default="0.125,0.25,0.5,1", help="comma-separated fractions of the data")
    p.add_argument("--same-steps", action="store_true", help="every size trains for the full size's steps")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from tandem.training.demo import DEMO_VERSION, ensure_demo_draft, ensure_demo_target
    from tandem.model_source import cache_root
    from tandem.training.data import load_samples

    target = ensure_demo_target(rebuild=True)  # a pair built here: its head's run folder holds the
    draft = ensure_demo_draft(rebuild=True)  # completed samples the sweep reuses (the shipped pair has none)
    run = draft.with_name("draft.run")
    samples, eval_samples = load_samples(run / "samples.jsonl"), load_samples(run / "eval_samples.jsonl")
    work = Path(args.out) if args.out else cache_root() / "demo" / DEMO_VERSION / ("sweep-same-steps" if args.same_steps else "sweep")
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = sweep(str(target), samples, eval_samples, fractions, work, args.same_steps)
    work.mkdir(parents=True, exist_ok=True)
    (work / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
