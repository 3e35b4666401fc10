"""``python -m drafter``: the EAGLE-3 draft service (see drafter/config.py for the flags)."""

from __future__ import annotations

import argparse
import logging
import sys

from tandem import tracing
from tandem.errors import TandemError
from tandem.service_runtime import run_service
from drafter.config import DrafterServiceConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m drafter", description="Tandem drafter: the EAGLE-3 head")
    DrafterServiceConfig.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        target = args.target_model
        draft = args.draft_model
        if target is None or draft is None:
            from tandem.demo import ensure_demo_draft, ensure_demo_target

            target = target or str(ensure_demo_target())
            draft = draft or str(ensure_demo_draft())
        cfg = DrafterServiceConfig.from_args(args, draft, target)
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tracing.setup_tracing("tandem-drafter", cfg.otlp_endpoint)
    from drafter.serve import serve

    return run_service(lambda: serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
