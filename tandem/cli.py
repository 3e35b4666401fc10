"""The ``tandem`` console script. Each sub-command imports what it needs when it runs, so
``tandem --help`` is instant and importing this module does not import torch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time

from tandem import args as shared
from tandem import speculative_flags
from tandem import command_line
from tandem.errors import TandemError


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="offline generation in one process (target only, or with an EAGLE-3 draft)",
                       formatter_class=command_line.HelpFormatter)
    shared.add(p, shared.MODEL, shared.REVISION, shared.TP_SIZE, shared.DEVICE, shared.CONFIG)
    speculative_flags.add_speculative(p, draft_help="EAGLE-3 draft folder; enables speculative decoding (default: the demo draft "
                                         "without --model, else none; 'none' turns it off)")
    shared.add(p, *shared.ENGINE_FLAGS)
    # (also after the subcommand, where users put it; SUPPRESS: absent here, `tandem -v generate` keeps its value)
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="log progress at INFO level (default: off, as tandem -v generate)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text, encoded with the tokenizer's special tokens (BOS) as "
                                         "transformers does (needs tokenizer.json, or tiktoken.model, in the model folder)")
    prompt.add_argument("--prompt-token-ids", help="comma-separated token ids, e.g. 1,2,3 (used as given)")
    p.add_argument("--max-new-tokens", type=int, required=True, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 = off")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=_run_generate)


def generate_settings(args: argparse.Namespace) -> tuple:
    """(EngineConfig, Speculative) from ``tandem generate``'s flags, whatever their spelling."""
    from tandem.engine.config import EngineConfig

    speculative = speculative_flags.resolve_speculative(args, args.model)
    if speculative.draft_model == shared.NO_DRAFT:
        speculative = dataclasses.replace(speculative, draft_model=None)
    speculative.require_draft()
    cfg = EngineConfig(model=args.model, device=shared.resolve_device(args.device), tp_size=args.tp_size,
                       **shared.engine_settings(args))
    return cfg, speculative


def _run_generate(args: argparse.Namespace) -> int:
    from tandem.sampling import SamplingParams
    from tandem.tokenizer import load_tokenizer, tokenizer_available

    args.model = shared.resolve_target(args)
    if args.model is None:  # the demo pair, as tandem up serves it ('--draft-model none': the target alone)
        from tandem.training.demo import ensure_demo_draft, ensure_demo_target

        args.model = str(ensure_demo_target())
        if args.draft_model is None and args.speculative_config is None:
            args.draft_model = str(ensure_demo_draft())
    tokenizer = load_tokenizer(args.model) if tokenizer_available(args.model) else None
    if args.prompt is not None:
        if tokenizer is None:
            raise TandemError(f"{args.model} has no tokenizer (tokenizer.json or tiktoken.model); use --prompt-token-ids")
        prompt = tokenizer.encode(args.prompt, add_special_tokens=True)
    else:
        try:
            prompt = [int(t) for t in args.prompt_token_ids.split(",") if t.strip()]
        except ValueError:
            raise TandemError(f"--prompt-token-ids must be comma-separated integers, got '{args.prompt_token_ids}'") from None
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
    cfg, speculative = generate_settings(args)
    with _build_engine(cfg, speculative) as engine:
        room = engine.context_len - len(prompt)
        if args.max_new_tokens > room:  # (as the gateway refuses it: not cut short without a word)
            raise TandemError(f"--max-new-tokens {args.max_new_tokens}: the prompt's {len(prompt)} tokens and that many "
                              f"new ones exceed the context length of {engine.context_len} served here (the model's, or "
                              f"--context-length / --max-model-len); lower it to "
                              f"at most {max(room, 0)}")
        started = time.perf_counter()
        result = engine.generate([prompt], params)[0]
        elapsed = time.perf_counter() - started
    out = result.output_token_ids
    report = {
        "output_token_ids": out,
        "finish_reason": result.finish_reason,
        # target-only: one forward per token; speculative: one verify round per accepted run (+ the prefill)
        "rounds": result.spec_stats.rounds + 1 if speculative.draft_model else len(out),
        "accept_length_mean": result.spec_stats.accept_length_mean,
        "acceptance_by_position": result.spec_stats.acceptance_by_position,
        "tokens_per_s": len(out) / elapsed if elapsed > 0 else 0.0,
    }
    if tokenizer is not None:
        report["text"] = tokenizer.decode(out)
    if args.json:
        print(json.dumps(report))
    else:
        print(report.get("text", out))
        print(f"[{len(out)} tokens, {report['tokens_per_s']:.1f} tok/s, finish: {result.finish_reason}, "
              f"device: {cfg.device}]", file=sys.stderr)
    return 0


def _add_up(sub: argparse._SubParsersAction) -> None:
    from tandem.launcher import add_up_arguments, run_up

    p = sub.add_parser("up", help="start drafter, verifier and gateway locally (the demo pair by default)",
                       formatter_class=command_line.HelpFormatter)
    add_up_arguments(p)
    p.unknown_hint = "a service's own flags go through --verifier-args, --drafter-args or --gateway-args"
    p.set_defaults(run=run_up)


def _build_engine(cfg, speculative: speculative_flags.Speculative):
    """The engine, with an in-process EAGLE-3 drafter when a draft model is given (validated first)."""
    from tandem.engine.llm_engine import LLMEngine

    if speculative.draft_model is None:
        return LLMEngine(cfg)
    from tandem.speculative.spec_config import SpecConfig
    from tandem.engine.speculative_setup import speculative_engine

    spec = SpecConfig(speculative.num_steps, speculative.topk, speculative.num_draft_tokens)
    return speculative_engine(cfg, speculative.draft_model, spec, draft_dtype=cfg.dtype)


def _add_training(sub: argparse._SubParsersAction) -> None:
    from tandem.training.cli import add_demo_models, add_train_drafter, run_demo_models, train_drafter_command

    p = sub.add_parser("train-drafter", help="train an EAGLE-3 head for a target (= python -m drafter.train)",
                       formatter_class=command_line.HelpFormatter)
    add_train_drafter(p)
    p.set_defaults(run=train_drafter_command)
    p = sub.add_parser("demo-models", help="build (once, cached) the demo target and its EAGLE-3 head")
    add_demo_models(p)
    p.set_defaults(run=run_demo_models)


def _add_reload(sub: argparse._SubParsersAction) -> None:
    from tandem.reload_client import add_arguments, run

    p = sub.add_parser("reload-drafter", help="make a running drafter serve another EAGLE-3 checkpoint, dropping nothing")
    add_arguments(p)
    p.set_defaults(run=run)


def build_parser() -> argparse.ArgumentParser:
    parser = command_line.ArgumentParser(prog="tandem", description="LLM serving with EAGLE-3 speculative decoding")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_up(sub)
    _add_training(sub)
    _add_reload(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = command_line.parse_args(build_parser(), argv, subcommand=True)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format=shared.LOG_FORMAT, stream=sys.stderr)
    try:
        return args.run(args)
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
