"""``python -m drafter``: the EAGLE-3 draft service (see drafter/config.py for the flags)."""

from __future__ import annotations

import argparse
import logging
import sys

from tandem import args as shared
from tandem import speculative_flags
from tandem import command_line
from tandem import tracing
from tandem.errors import TandemError
from tandem.service_runtime import die_with_launcher, run_service
from drafter.config import DrafterServiceConfig


def build_parser() -> argparse.ArgumentParser:
    parser = command_line.ArgumentParser(prog="python -m drafter", description="Tandem drafter: the EAGLE-3 head",
                                     formatter_class=command_line.HelpFormatter)
    DrafterServiceConfig.add_arguments(parser)
    shared.add(parser, shared.CONFIG)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()  # (started by `tandem up`: not outliving it)
    args = command_line.parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format=shared.LOG_FORMAT)
    try:
        from tandem.training.demo import ensure_demo_draft, ensure_demo_target
        from tandem.model_source import resolve_model

        target = resolve_model(args.target_model, flag="--target-model") if args.target_model else str(ensure_demo_target())
        draft = speculative_flags.resolve_speculative(args, target).draft_model or str(ensure_demo_draft())
        cfg = DrafterServiceConfig.from_args(args, draft, target)
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.getLogger("drafter").info("config: draft=%s, target=%s, device=%s", draft, target, cfg.runtime.device)
    tracing.setup_tracing("tandem-drafter", cfg.otlp_endpoint)
    from drafter.serve import serve

    return run_service(lambda: serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
