"""``python -m gateway --verifier HOST:PORT --model-dir DIR [--host H] [--port P] [--grpc-port G]
[--served-model-name NAME] [--otlp-endpoint URL] [--max-tokens-limit N] [--api-key KEY]
[--max-body-bytes N] [--max-concurrent-requests N] [--verifier-metrics-url URL]
[--max-message-interval-ms MS] [--metrics-prefix tandem|vllm]`` (gateway/config.py).

Runs the REST and gRPC servers on one event loop (uvloop when installed) until SIGINT/SIGTERM,
then drains: streams in flight get the grace period, new requests are refused.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from gateway.config import build_parser, config_from_args
from gateway.server import Gateway
from tandem import args as shared
from tandem import command_line
from tandem import tracing
from tandem.errors import TandemError
from tandem.service_runtime import check_can_listen, die_with_launcher, freeze_startup_heap, raise_open_files_limit

log = logging.getLogger("gateway")


async def serve(gateway: Gateway) -> None:
    # uvicorn captures SIGINT/SIGTERM while it runs and re-raises them when it is done; these
    # handlers make both the early signal (during start-up) and the re-raised one a clean stop
    # rather than a KeyboardInterrupt in the middle of draining.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: gateway.request_stop())
    try:
        await gateway.start()
    except BaseException:  # (a taken REST port after gRPC started: its server stopped here, not at exit's collection)
        await gateway.stop()
        raise
    # What start-up left (FastAPI, pydantic, gRPC, the tokenizer: ~50k objects) out of the collector's
    # generations: a full collection walked them all, 35-65 ms on a CPU core, in the middle of a stream.
    freeze_startup_heap()
    try:
        await gateway.wait()
    finally:
        log.info("gateway stopping")
        await gateway.stop()


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()  # (started by `tandem up`: not outliving it)
    args = command_line.parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format=shared.LOG_FORMAT)
    try:
        cfg = config_from_args(args)
        gateway = Gateway(cfg)
    except (ValueError, OSError) as e:  # a bad flag or model folder: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check_config:  # (tandem up asks before the models load: the ports too)
        try:
            check_can_listen(cfg.host, (cfg.port, cfg.grpc_port))
        except TandemError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    log.info("%s", cfg)
    raise_open_files_limit()  # (a client connection a descriptor)
    tracing.setup_tracing("tandem-gateway", cfg.otlp_endpoint)
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(serve(gateway))
    except OSError as e:  # the port is taken, the address is not ours
        print(f"error: cannot listen on {cfg.host} ports {cfg.port}/{cfg.grpc_port}: {e}", file=sys.stderr)
        return 1
    except TandemError as e:  # (the gRPC port's: tandem.service_runtime.listen)
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown_tracing()
    return 0


if __name__ == "__main__":
    sys.exit(main())
