"""``python -m verifier``: the target-model service (see verifier/config.py for the flags)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tandem import args as shared
from tandem import command_line
from tandem import tracing
from tandem.errors import TandemError
from tandem.service_runtime import die_with_launcher, run_service
from verifier.config import VerifierConfig


def build_parser() -> argparse.ArgumentParser:
    parser = command_line.ArgumentParser(prog="python -m verifier", description="Tandem verifier: the target model",
                                     formatter_class=command_line.HelpFormatter)
    VerifierConfig.add_arguments(parser)
    shared.add(parser, shared.CONFIG)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()  # (started by `tandem up`: not outliving it)
    args = command_line.parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format=shared.LOG_FORMAT)
    try:
        model = shared.resolve_target(args)
        if model is None:
            from tandem.training.demo import ensure_demo_target

            model = str(ensure_demo_target())
        cfg = VerifierConfig.from_args(args, model)
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.getLogger("verifier").info("config: model=%s, device=%s, %s", model, cfg.engine.device, cfg.describe())
    tracing.setup_tracing("tandem-verifier", cfg.otlp_endpoint)
    from verifier.engine_api import EngineFailed
    from verifier.serve import StoppedWhileLoading, serve

    try:
        return run_service(lambda: serve(cfg))
    except EngineFailed as e:  # its requests were failed; a supervisor (tandem up, compose) restarts it
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except StoppedWhileLoading:  # (the load's thread cannot be stopped: the process ends under it)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
