"""The ``tandem`` console script. Each sub-command imports what it needs when it runs, so
``tandem --help`` is instant and importing this module does not import torch."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from tandem.errors import TandemError


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="offline generation in one process (target only, or with an EAGLE-3 draft)")
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: the embedded demo model)")
    p.add_argument("--draft-model", default=None, help="EAGLE-3 draft folder; enables speculative decoding")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (checkpoint dtype on GPU, float32 on CPU), bfloat16, float16, float32")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json in the model folder)")
    prompt.add_argument("--prompt-token-ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=8)
    p.add_argument("--decode-steps", type=int, default=None,
                   help="plain decode steps queued back to back (default: 4 with CUDA graphs, else 1)")
    p.add_argument("--spec-rounds", type=int, default=None,
                   help="greedy chain rounds queued back to back (default: 4 with CUDA graphs, else 1)")
    p.add_argument("--no-overlap-runs", action="store_true",
                   help="read each run of --decode-steps or --spec-rounds back before queuing the next (default: the "
                        "next is queued first)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from tandem.engine.config import EngineConfig
    from tandem.sampling import SamplingParams
    from tandem.tokenizer import TextTokenizer

    if args.model is None:
        from tandem.demo import ensure_demo_target

        args.model = str(ensure_demo_target())
    tokenizer = TextTokenizer(args.model) if TextTokenizer.available(args.model) else None
    if args.prompt is not None:
        if tokenizer is None:
            raise TandemError(f"{args.model} has no tokenizer.json; use --prompt-token-ids")
        prompt = tokenizer.encode(args.prompt)
    else:
        try:
            prompt = [int(t) for t in args.prompt_token_ids.split(",") if t.strip()]
        except ValueError:
            raise TandemError(f"--prompt-token-ids must be comma-separated integers, got '{args.prompt_token_ids}'") from None
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, tp_size=args.tp_size,
                       disable_cuda_graph=args.disable_cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs,
                       decode_steps=args.decode_steps, spec_rounds=args.spec_rounds,
                       overlap_runs=not args.no_overlap_runs)
    with _build_engine(cfg, args) as engine:
        started = time.perf_counter()
        result = engine.generate([prompt], params)[0]
        elapsed = time.perf_counter() - started
    out = result.output_token_ids
    report = {
        "output_token_ids": out,
        "finish_reason": result.finish_reason,
        # target-only: one forward per token; speculative: one verify round per accepted run (+ the prefill)
        "rounds": result.spec_stats.rounds + 1 if args.draft_model else len(out),
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
        print(f"[{len(out)} tokens, {report['tokens_per_s']:.1f} tok/s, finish: {result.finish_reason}]", file=sys.stderr)
    return 0


def _add_up(sub: argparse._SubParsersAction) -> None:
    from tandem.launcher import add_up_arguments, run_up

    p = sub.add_parser("up", help="start drafter, verifier and gateway locally (the demo pair by default)")
    add_up_arguments(p)
    p.set_defaults(run=run_up)


def _build_engine(cfg, args: argparse.Namespace):
    """The engine, with an in-process EAGLE-3 drafter when --draft-model is given (validated first)."""
    from tandem.engine.llm_engine import LLMEngine

    if args.draft_model is None:
        return LLMEngine(cfg)
    from tandem.speculative.drafter import SpecConfig
    from tandem.speculative.setup import speculative_engine

    steps = args.speculative_num_steps or 3
    topk = args.speculative_eagle_topk or 1
    spec = SpecConfig(steps, topk, args.speculative_num_draft_tokens or (steps + 1 if topk == 1 else 2 * steps))
    return speculative_engine(cfg, args.draft_model, spec, draft_dtype=args.dtype)


def _add_training(sub: argparse._SubParsersAction) -> None:
    from tandem.training.cli import add_demo_models, add_train_drafter, run_demo_models, run_train_drafter

    p = sub.add_parser("train-drafter", help="train an EAGLE-3 head for a target (= python -m drafter.train)")
    add_train_drafter(p)
    p.set_defaults(run=run_train_drafter)
    p = sub.add_parser("demo-models", help="build (once, cached) the demo target and its EAGLE-3 head")
    add_demo_models(p)
    p.set_defaults(run=run_demo_models)


def _add_reload(sub: argparse._SubParsersAction) -> None:
    from tandem.reload_client import add_arguments, run

    p = sub.add_parser("reload-drafter", help="make a running drafter serve another EAGLE-3 checkpoint, dropping nothing")
    add_arguments(p)
    p.set_defaults(run=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="LLM serving with EAGLE-3 speculative decoding")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_up(sub)
    _add_training(sub)
    _add_reload(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.run(args)
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
