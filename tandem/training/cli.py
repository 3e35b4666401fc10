"""Command lines of the training side: ``python -m drafter.train`` (= ``tandem train-drafter``) and
``tandem demo-models``. Each ``add_*`` fills an argparse parser and each ``run_*`` takes the parsed
namespace, so the ``tandem`` console script can register them as sub-commands as they are."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from tandem import args as shared
from tandem import internal_secret
from tandem.args import LOG_FORMAT
from tandem.command_line import ArgumentParser, HelpFormatter
from tandem.errors import TandemError


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_train_drafter(p: argparse.ArgumentParser) -> None:
    # (second names: SpecForge's spellings of the same settings)
    p.add_argument("--target-model", "--model", "--target-model-path", dest="target_model", default=None,
                   help="target HF model folder (default: the embedded demo target)")
    p.add_argument("--data", "--train-data-path", dest="data", default=None, help="JSONL: {prompt | prompt_token_ids | messages | conversations} [+ response | response_token_ids]")
    p.add_argument("--traffic", action="append", default=[], metavar="DIR",
                   help="served traffic captured by python -m verifier --capture-traffic DIR (repeatable; "
                        "alone or with --data): its stored features need no target forward")
    p.add_argument("--reload-drafter", default=None, metavar="HOST:PORT",
                   help="when done, make the drafter service there serve the new head (tandem reload-drafter)")
    shared.add(p, shared.INTERNAL_SECRET_FILE)  # (the drafter's, for --reload-drafter: tandem up prints where it is)
    p.add_argument("--out", "--output-dir", dest="out", default=None, help="draft folder to write (SGLang LlamaForCausalLMEagle3 format)")
    p.add_argument("--run-dir", default=None, help="samples, vocabulary and checkpoints (default: OUT.run)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder (samples, vocab, checkpoint)")
    g = p.add_argument_group("responses")
    g.add_argument("--max-new-tokens", type=int, default=256, help="tokens the target writes per response")
    g.add_argument("--temperature", type=float, default=0.0, help="of the target's responses (0 = greedy)")
    g.add_argument("--regenerate", action="store_true", help="let the target rewrite responses given in the data")
    g.add_argument("--max-samples", type=int, default=None, help="train on at most this many samples (default: all)")
    g = p.add_argument_group("head and training")
    g.add_argument("--draft-vocab-size", type=int, default=None, help="default min(32000, target vocab)")
    g.add_argument("--capture-layers", type=_ints, default=None, help="target layer inputs, e.g. 2,16,29 (default [2, N//2, N-3])")
    g.add_argument("--ttt-steps", "--ttt-length", dest="ttt_steps", type=int, default=7,
                   help="training-time test: the head's own steps unrolled per position")
    g.add_argument("--loss", choices=["soft", "hard"], default="soft", help="target distribution or target argmax")
    g.add_argument("--include-prompt-loss", action="store_true", help="also train on prompt positions")
    g.add_argument("--epochs", "--num-epochs", dest="epochs", type=float, default=2.0, help="passes over the samples")
    g.add_argument("--max-steps", type=int, default=None, help="overrides --epochs")
    g.add_argument("--batch-size", type=int, default=8, help="samples per optimizer step")
    g.add_argument("--lr", "--learning-rate", dest="lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup-steps", type=int, default=30, help="steps of linear warm-up to the peak rate")
    g.add_argument("--checkpoint-every", "--save-interval", dest="checkpoint_every", type=int, default=100,
                   help="steps between checkpoints in the run folder")
    g.add_argument("--no-compile", action="store_true", help="train eagerly (no torch.compile)")
    g.add_argument("--seed", type=int, default=0, help="of the head's initialisation and the sample order")
    g = p.add_argument_group("devices")
    g.add_argument("--tp-size", "--tensor-parallel-size", "--tp", dest="tp_size", type=shared.ranks, default=1,
                   help="tensor parallelism of the target (teacher and evaluation)")
    g.add_argument("--device", default="auto", help="auto: cuda when torch sees a GPU, else cpu")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-data", "--eval-data-path", dest="eval_data", default=None, help="held-out JSONL (default: a slice of --data)")
    g.add_argument("--eval-fraction", type=float, default=0.05, help="of --data held out for evaluation")
    g.add_argument("--max-eval-prompts", type=int, default=64, help="held-out prompts evaluated")
    g.add_argument("--eval-max-new-tokens", type=int, default=96, help="tokens generated per evaluated prompt")
    g.add_argument("--speculative-num-steps", type=int, default=5, help="the evaluation's draft depth")
    g.add_argument("--speculative-eagle-topk", type=int, default=1, help="the evaluation's branching per step")
    g.add_argument("--speculative-num-draft-tokens", type=int, default=6, help="the evaluation's tree size")
    g.add_argument("--no-eval", action="store_true", help="skip the speculative evaluation after training")
    g.add_argument("--eval-only", action="store_true", help="only evaluate --draft-model against --target-model: on "
                   "--eval-data / --data, else the prompts its training held out (DRAFT.run), else the demo's")
    g.add_argument("--draft-model", default=None, help="with --eval-only: the draft folder to evaluate")
    g.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _check_before_loading(args: argparse.Namespace) -> None:
    """What the command line can get wrong, refused before the target loads (minutes for a large one)."""
    from tandem.configs.model import ModelConfig
    from tandem.training.pipeline import run_folder

    for flag, value, least in (("--ttt-steps", args.ttt_steps, 1), ("--batch-size", args.batch_size, 1),
                               ("--checkpoint-every", args.checkpoint_every, 1), ("--max-steps", args.max_steps, 1),
                               ("--draft-vocab-size", args.draft_vocab_size, 2), ("--max-new-tokens", args.max_new_tokens, 1),
                               ("--warmup-steps", args.warmup_steps, 0), ("--max-samples", args.max_samples, 1),
                               ("--max-eval-prompts", args.max_eval_prompts, 1), ("--threads", args.threads, 1),
                               ("--eval-max-new-tokens", args.eval_max_new_tokens, 1)):
        if value is not None and value < least:
            raise TandemError(f"{flag} must be at least {least}, got {value}")
    for flag, value, ok, want in (("--lr", args.lr, args.lr > 0, "a positive number"),
                                  ("--epochs", args.epochs, args.epochs > 0, "a positive number"),
                                  ("--temperature", args.temperature, args.temperature >= 0, "0 (greedy) or more"),
                                  ("--eval-fraction", args.eval_fraction, 0 <= args.eval_fraction < 1, "in [0, 1)")):
        if not (math.isfinite(value) and ok):
            raise TandemError(f"{flag} must be {want}, got {value}")
    out, target = Path(args.out).resolve(), Path(args.target_model).resolve()
    if out == target or target in out.parents or out in target.parents:
        raise TandemError(f"--out {args.out} is (or holds, or lies in) the target's folder: the head is written elsewhere")
    _check_out(args.out, out)
    run = run_folder(args.out, args.run_dir)
    try:  # (made now, named by its flag: not an errno naming the derived folder after the target's responses)
        run.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        flag = f"--run-dir {args.run_dir}" if args.run_dir else f"--out {args.out}"
        raise TandemError(f"{flag}: cannot create the run folder {run} ({e.strerror})") from None
    model = ModelConfig.from_dir(args.target_model)
    layers = args.capture_layers
    if layers is not None and (len(layers) != 3 or not all(0 <= i < model.num_layers for i in layers)):
        raise TandemError(f"--capture-layers {','.join(map(str, layers))}: an EAGLE-3 head reads three target layers, "
                          f"each in [0, {model.num_layers})")
    _check_files(args)
    if not args.no_eval:  # (the evaluation's shape, found wrong now rather than after training)
        from tandem.speculative.spec_config import SpecConfig

        SpecConfig(num_steps=args.speculative_num_steps, topk=args.speculative_eagle_topk,
                   num_draft_tokens=args.speculative_num_draft_tokens)
    if args.draft_vocab_size is not None and args.draft_vocab_size > model.vocab_size:
        raise TandemError(f"--draft-vocab-size {args.draft_vocab_size} exceeds the target's vocabulary of "
                          f"{model.vocab_size} tokens")
    if args.reload_drafter is not None and not args.reload_drafter.rpartition(":")[2].isdigit():
        raise TandemError(f"--reload-drafter {args.reload_drafter}: want HOST:PORT")
    if args.reload_drafter is not None:
        internal_secret.load(args.internal_secret_file)  # (an unreadable file found now, not after training)


def _check_files(args: argparse.Namespace) -> None:
    """--data and --eval-data: files that exist (a folder said so)."""
    for flag, value in (("--data", args.data), ("--eval-data", args.eval_data)):
        if value is not None and not Path(value).is_file():
            raise TandemError(f"{flag} {value}: " + ("a folder, not a JSONL file" if Path(value).is_dir() else
                                                      "no such file"))


def _check_out(given: str, out: Path) -> None:
    """--out: a folder this run may write — not a file, not another model, not a head this trainer did not make
    (its config's TRAINED_MARK, or its training.json: a copied head would be replaced without a word, --resume or
    not), and writable (found now, not after the target's responses were generated)."""
    from tandem.training.eagle3_train import TRAINED_MARK
    from tandem.training.lm import check_not_in_package

    check_not_in_package(out)
    if out.exists() and not out.is_dir():
        raise TandemError(f"--out {given}: is a file, not a folder")
    config = out / "config.json"
    if config.is_file():
        text = config.read_text()
        if "Eagle3" not in text:
            raise TandemError(f"--out {given} holds a model that is not an EAGLE-3 head: not overwritten; give a new "
                              "folder")
        if TRAINED_MARK not in text and not (out / "training.json").is_file():
            raise TandemError(f"--out {given} holds an EAGLE-3 head this trainer did not write: not overwritten; give a "
                              "new folder")
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TandemError(f"--out {given}: {existing} is not writable")


def job_from_args(args: argparse.Namespace):
    from tandem.training.eagle3_train import Eagle3TrainConfig
    from tandem.training.evaluate import EvalConfig
    from tandem.training.optim import OptimConfig
    from tandem.training.pipeline import DrafterTrainJob

    train = Eagle3TrainConfig(
        ttt_steps=args.ttt_steps, loss_type=args.loss, batch_size=args.batch_size, epochs=args.epochs,
        max_steps=args.max_steps, include_prompt_loss=args.include_prompt_loss, checkpoint_every=args.checkpoint_every,
        compile=not args.no_compile,
        optim=dataclasses.replace(OptimConfig(lr=args.lr, warmup_steps=args.warmup_steps, grad_clip=0.5)))
    evaluation = EvalConfig(num_steps=args.speculative_num_steps, topk=args.speculative_eagle_topk,
                            num_draft_tokens=args.speculative_num_draft_tokens, max_new_tokens=args.eval_max_new_tokens)
    return DrafterTrainJob(
        target_model=args.target_model, out=args.out, data=args.data, traffic=tuple(args.traffic), run_dir=args.run_dir,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, regenerate=args.regenerate,
        max_samples=args.max_samples, eval_data=args.eval_data, eval_fraction=args.eval_fraction,
        max_eval_prompts=args.max_eval_prompts, draft_vocab_size=args.draft_vocab_size,
        capture_layers=args.capture_layers, tp_size=args.tp_size, device=args.device, seed=args.seed,
        train=train, eval=None if args.no_eval else evaluation)


def run_train_drafter(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.target_model is None:
        from tandem.training.demo import ensure_demo_target

        args.target_model = str(ensure_demo_target())
    from tandem.args import resolve_device

    args.device = resolve_device(args.device)
    if args.eval_only:
        return _eval_only(args)
    if args.out is None:
        raise TandemError("--out is required (the draft folder to write)")
    if args.data is None and not args.traffic:
        raise TandemError("--data or --traffic is required (a JSONL of prompts, conversations or completed samples; "
                          "or a folder of captured traffic)")
    _check_before_loading(args)
    from tandem.training.pipeline import run_job

    import signal

    from tandem.training.eagle3_train import TrainingInterrupted

    job = job_from_args(args)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a checkpoint of the last whole step, as on Ctrl-C
    try:
        summary = run_job(job, resume=args.resume)
    except KeyboardInterrupt:  # (while the target wrote responses: those written so far are kept)
        raise TrainingInterrupted(f"interrupted; the run folder {job.run_path} keeps what was done: --resume goes "
                                  "on from there") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        print(json.dumps(summary, default=str))
    if args.reload_drafter:
        from tandem.reload_client import reload_drafter

        reply = reload_drafter(args.reload_drafter, args.out, secret=internal_secret.load(args.internal_secret_file))
        print(f"drafter at {args.reload_drafter} now serves {reply.draft_model} (generation {reply.generation})",
              file=sys.stderr)
    return 0


def _eval_only(args: argparse.Namespace) -> int:
    from tandem.training.data import fit_context, read_jsonl
    from tandem.training.evaluate import evaluate_pair, format_report
    from tandem.configs.model import ModelConfig

    if args.draft_model is None:
        raise TandemError("--eval-only needs --draft-model DIR")
    _check_files(args)
    source = args.eval_data or args.data
    from tandem.training.pipeline import EVAL_SAMPLES, run_folder

    held_out = run_folder(args.draft_model, args.run_dir) / EVAL_SAMPLES
    if source is None and held_out.is_file():  # the slice its training held out (its run folder's)
        from tandem.training.data import load_samples

        prompts = [list(s.prompt) for s in load_samples(held_out)[: args.max_eval_prompts]]
    elif source is None:
        from tandem.training.demo_pair import demo_eval_prompts

        prompts = demo_eval_prompts(args.target_model, args.max_eval_prompts)
    else:
        context = ModelConfig.from_dir(args.target_model).max_position_embeddings
        samples = read_jsonl(source, args.target_model, limit=args.max_eval_prompts)
        prompts = [list(fit_context(s, context).prompt) for s in samples]
    job = job_from_args(args)
    cfg = dataclasses.replace(job.eval, device=args.device, tp_size=args.tp_size, seed=args.seed)
    report = evaluate_pair(args.target_model, args.draft_model, prompts, cfg)
    print(json.dumps(report, default=str) if args.json else format_report(report))
    return 0


def add_demo_models(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eval", action="store_true", help="measure the pair's acceptance and speed on held-out prompts")
    p.add_argument("--rebuild", action="store_true", help="train the pair from its recipes into the cache (once) "
                                                          "instead of using the one shipped in the package")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true")
    p.add_argument("--variant", choices=("demo", "gpu"), default="demo",
                   help="demo: the embedded CPU pair (shipped, or --rebuild); gpu: the larger pair, trained into --out")
    p.add_argument("--out", default=None, help="folder for --variant gpu or --head-data-temperature")
    p.add_argument("--device", default="cuda", help="device for --variant gpu")
    p.add_argument("--head-data-temperature", type=float, default=None, metavar="T",
                   help="demo: train another head for the demo target into --out, on its responses sampled at T "
                        "(the shipped head learns from greedy ones), and evaluate it at T=0 and T=1")
    p.add_argument("--target", default=None, help="with --head-data-temperature: the demo target folder "
                                                  "(default: the cached one)")


def run_demo_models(args: argparse.Namespace) -> int:
    """Build (once; cached) the demo target and its EAGLE-3 head, print their folders; or, with
    ``--variant gpu``, train the larger pair into ``--out``; or train another head at a temperature."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.variant == "gpu":
        return _build_gpu_pair(args)
    if args.head_data_temperature is not None:
        return _head_at_temperature(args)
    from tandem.training.demo import ensure_demo_draft, ensure_demo_target

    target, draft = ensure_demo_target(args.rebuild), ensure_demo_draft(args.rebuild)
    result: dict = {"target": str(target), "draft": str(draft)}
    if args.eval:
        from tandem.training.demo_pair import demo_eval_prompts
        from tandem.training.evaluate import EvalConfig, evaluate_pair, format_report

        result["eval"] = evaluate_pair(str(target), str(draft), demo_eval_prompts(str(target)), EvalConfig())
        if not args.json:
            print(format_report(result["eval"]), file=sys.stderr)
    print(json.dumps(result, default=str) if args.json else f"target: {target}\ndraft:  {draft}")
    return 0


def _build_gpu_pair(args: argparse.Namespace) -> int:
    from tandem.training.demo_pair import build_gpu_pair

    if args.head_data_temperature is not None:
        raise TandemError("--head-data-temperature applies to the demo variant")
    if not args.out:
        raise TandemError("--variant gpu needs --out DIR")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise TandemError("--variant gpu trains on a GPU and none is visible; --device cpu runs it here (hours)")
    build_gpu_pair(Path(args.out), device=args.device)
    return 0


def _head_at_temperature(args: argparse.Namespace) -> int:
    from tandem.training.demo import ensure_demo_target
    from tandem.training.demo_pair import build_demo_draft

    if not args.out:
        raise TandemError("--head-data-temperature needs --out DIR")
    target = args.target or str(ensure_demo_target())
    summary = build_demo_draft(target, Path(args.out), evaluate=True, temperature=args.head_data_temperature)
    print(json.dumps(summary.get("eval", summary), indent=2))
    return 0


def main_train_drafter(argv: list[str] | None = None) -> int:
    import logging

    p = ArgumentParser(prog="python -m drafter.train", formatter_class=HelpFormatter,
                       description="Train an EAGLE-3 draft head for a target (training-time test)")
    add_train_drafter(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    return train_drafter_command(args)


def train_drafter_command(args: argparse.Namespace) -> int:
    """run_train_drafter with its failures as one line, for both entry points (``tandem train-drafter`` and
    ``python -m drafter.train``)."""
    try:
        return run_train_drafter(args)
    except (TandemError, ValueError, OSError) as e:  # (OSError: a disk that filled, a folder removed meanwhile)
        print(f"error: {e}", file=sys.stderr)
        return 2
