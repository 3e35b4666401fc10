"""The gateway's settings: one frozen dataclass, read once from the command line and passed down."""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

from tandem import args as shared, internal_secret
from tandem import command_line
from tandem.args import API_KEY_ENV, MODEL, served_name
from tandem.command_line import HelpFormatter

UPSTREAM_STREAMS = ("one", "per-request")  # --upstream-streams
METRICS_PREFIXES = ("tandem", "vllm")  # --metrics-prefix: the /metrics families' name space (vllm: as vLLM names them)


@dataclass(frozen=True)
class GatewayConfig:
    verifier: str  # host:port of the verifier's gRPC server (rank 0)
    model_dir: str  # the target's folder: tokenizer.json, tokenizer_config.json (chat template)
    host: str = "127.0.0.1"
    port: int = 8000  # OpenAI-compatible REST API; 0 picks a free port
    grpc_port: int = 50050  # public gRPC Generation service; 0 picks a free port
    served_model_name: str | None = None  # default: the model folder's name
    served_model_aliases: tuple[str, ...] = ()  # --served-model-name's further names (vLLM takes several), also accepted
    otlp_endpoint: str | None = None  # default: OTEL_EXPORTER_OTLP_ENDPOINT, else tracing off
    max_tokens_limit: int | None = shared.MAX_TOKENS_LIMIT.default  # cap on max_tokens besides the model's context
    default_max_tokens: int = 16  # completions without max_tokens (the OpenAI default)
    upstream_timeout_s: float = 3.0  # model-info and health calls to the verifier
    health_poll_s: float = 2.0  # how often gRPC health mirrors the verifier's
    shutdown_grace_s: float = 5.0  # streams in flight get this long to finish on SIGTERM
    api_key: str | None = field(default=None, repr=False)  # required as a bearer token on /v1/* and gRPC; None = open
    internal_secret: str | None = field(default=None, repr=False)  # presented to the verifier (tandem.internal_secret)
    max_body_bytes: int = shared.MAX_BODY_BYTES.default  # larger request bodies get 413 before they are read
    body_timeout_s: float = 30.0  # a body still arriving after this gets 408 (a slow upload holds its connection)
    max_concurrent_requests: int = shared.MAX_CONCURRENT.default  # generations in flight (REST and gRPC)
    max_queue_wait_s: float = shared.MAX_QUEUE_WAIT.default  # a REST request's wait in line at capacity; then 429
    max_connections_per_address: int = shared.MAX_CONNECTIONS_PER_ADDRESS.default  # REST connections a client; 0: any
    verifier_metrics_url: str | None = None  # the verifier's /metrics, appended to ours; None = ours only
    drafter_metrics_url: str | None = None  # the drafter service's /metrics, appended too
    verifier_metrics_timeout_s: float = 1.0  # a scrape of ours waits this long for the verifier's
    generation_config: str = shared.GENERATION_CONFIG.default  # auto (the model's generation_config.json), vllm, DIR
    log_requests: bool = False  # --log-requests: a line per finished generation (gateway/request_log.py)
    access_log: bool = True  # a line per HTTP request, refused ones too (uvicorn's; --disable-uvicorn-access-log)
    log_requests_level: int = shared.LOG_REQUESTS_LEVEL.default  # 0 numbers, 1 + sampling, 2 + prompt and output
    keep_alive_s: float = shared.TIMEOUT_KEEP_ALIVE.default  # an idle HTTP (or call-less gRPC) connection lasts this long
    chat_template: str | None = None  # --chat-template: a file or the template itself; None = the model folder's
    max_message_interval_ms: float = 50.0  # the longest a stream's tokens wait while this loop falls behind; 0: never
    metrics_prefix: str = "tandem"  # /metrics families as tandem:NAME, or vllm:NAME (vLLM's dashboards)
    # "one": every generation over one GenerateMany stream to the verifier, a step's tokens for all of them in one
    # message (gateway/upstream_many.py; a verifier without it: a stream each); "per-request": a Generate stream each
    upstream_streams: str = "one"
    tool_call_parser: str | None = None  # --tool-call-parser: a chat answer's tool calls read (gateway/tool_calls.py)
    reasoning_parser: str | None = None  # --reasoning-parser: its <think> text apart (gateway/reasoning.py)

    def __post_init__(self):
        if ":" not in self.verifier:
            raise ValueError(f"--verifier must be HOST:PORT, got {self.verifier!r}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"--max-tokens-limit must be at least 1, got {self.max_tokens_limit}")
        if self.api_key is not None and not _header_token(self.api_key):
            raise ValueError("--api-key must be non-empty printable ASCII without spaces (it travels in a header)")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"--max-concurrent-requests must be at least 1, got {self.max_concurrent_requests}")
        if not 0 <= self.max_queue_wait_s < float("inf"):
            raise ValueError(f"--max-queue-wait-s must be 0 or more seconds, got {self.max_queue_wait_s}")
        if self.max_connections_per_address < 0:
            raise ValueError("--max-connections-per-address must be 0 (no limit) or more, got "
                             f"{self.max_connections_per_address}")
        for flag, url in (("--verifier-metrics-url", self.verifier_metrics_url),
                          ("--drafter-metrics-url", self.drafter_metrics_url)):
            if url is not None and not url.startswith(("http://", "https://")):
                raise ValueError(f"{flag} must be an http(s) URL, got {url!r}")
        if not self.keep_alive_s >= 1:
            raise ValueError(f"--timeout-keep-alive must be at least 1 second, got {self.keep_alive_s}")
        if not 0 <= self.max_message_interval_ms <= 1000:
            raise ValueError(f"--max-message-interval-ms must be within 0-1000, got {self.max_message_interval_ms}")
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ValueError(f"--metrics-prefix must be one of {', '.join(METRICS_PREFIXES)}, got {self.metrics_prefix!r}")
        if self.upstream_streams not in UPSTREAM_STREAMS:
            raise ValueError(f"--upstream-streams must be one of {', '.join(UPSTREAM_STREAMS)}, got "
                             f"{self.upstream_streams!r}")
        if self.log_requests_level not in (0, 1, 2):
            raise ValueError(f"--log-requests-level must be 0, 1 or 2, got {self.log_requests_level}")
        if self.tool_call_parser not in (None, *shared.TOOL_CALL_PARSERS):
            raise ValueError(f"--tool-call-parser must be one of {', '.join(shared.TOOL_CALL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *shared.REASONING_PARSERS):
            raise ValueError(f"--reasoning-parser must be one of {', '.join(shared.REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if not Path(self.model_dir).is_dir():
            raise ValueError(f"--model-dir {self.model_dir}: no such folder")

    @functools.cached_property
    def model_name(self) -> str:
        """The name clients put in ``model`` (and what /v1/models lists); resolved once (it walks the folder's
        path, and every request asks)."""
        return served_name(self.model_dir, self.served_model_name)

    @property
    def open_to_all(self) -> bool:
        """Whether the APIs take anyone's requests from beyond this host: bound past loopback with no key (the
        verifier and drafter refuse the like without their secret; a public API may be meant, so a warning)."""
        return self.api_key is None and not internal_secret.is_loopback(self.host)

    @functools.cached_property
    def model_names(self) -> tuple[str, ...]:
        """What a request's ``model`` may say: the served name, and without --served-model-name also the model's
        path as the server was given it (vLLM's and SGLang's default name, which their clients send)."""
        if self.served_model_name is not None:
            return (self.model_name, *self.served_model_aliases)
        return tuple(dict.fromkeys((self.model_name, self.model_dir, str(Path(self.model_dir).resolve()))))


def _header_token(s: str) -> bool:
    return bool(s) and s.isascii() and s.isprintable() and " " not in s


def build_parser() -> argparse.ArgumentParser:
    d = GatewayConfig
    p = command_line.ArgumentParser(prog="python -m gateway",
                                description="Tandem gateway: OpenAI-compatible REST and gRPC in front of the verifier.",
                                formatter_class=HelpFormatter)
    p.add_argument("--verifier", required=True, help="the verifier's gRPC address, HOST:PORT")
    p.add_argument("--check-config", action="store_true",
                   help="check the flags, the model folder (tokenizer, chat template, generation config) and that the "
                        "REST and gRPC ports can be bound, then exit (tandem up runs this before any model loads)")
    p.add_argument("--model-dir", *MODEL.names, dest="model_dir", required=True,
                   help="the target's folder: tokenizer.json, its chat template, generation_config.json")
    p.add_argument("--host", default=d.host, help="address to listen on (REST and gRPC)")
    p.add_argument("--port", type=shared.port, default=d.port, help="REST port (OpenAI API)")
    p.add_argument("--grpc-port", type=shared.port, default=d.grpc_port, help="public gRPC port")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name clients send; more names, as vLLM takes them, are accepted too (default: the "
                        "folder's name)")
    shared.add(p, shared.OTLP_ENDPOINT)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/*, SGLang's and vLLM's other routes (/generate, "
                        f"/tokenize, ...) and the gRPC API (default: ${API_KEY_ENV}, else open); /health, /ping and "
                        "/metrics stay open")
    p.add_argument("--verifier-metrics-url", default=None,
                   help="the verifier's Prometheus URL (http://HOST:PORT/metrics), served within our /metrics")
    p.add_argument("--drafter-metrics-url", default=None,
                   help="the drafter service's Prometheus URL, served within our /metrics too")
    p.add_argument("--upstream-streams", choices=UPSTREAM_STREAMS, default=d.upstream_streams,
                   help="the generations to the verifier over one stream, a message a step for all of them (one), or "
                        "a stream each (per-request)")
    p.add_argument("--max-message-interval-ms", type=float, default=d.max_message_interval_ms,
                   help="while the gateway's event loop falls behind, the verifier sends a stream's tokens together, at "
                        "most this far apart (the first tokens and the last never wait); 0: a message every step")
    p.add_argument("--metrics-prefix", choices=METRICS_PREFIXES, default=d.metrics_prefix,
                   help="the name space of /metrics (the gateway's and the services' it relays): vllm names the families "
                        "as vLLM does (vllm:num_requests_running, vllm:time_to_first_token_seconds, ...), for its "
                        "dashboards")
    shared.add(p, *shared.GATEWAY_FLAGS, shared.CONFIG, shared.LOG_LEVEL, shared.INTERNAL_SECRET_FILE)
    p.add_argument("--uvicorn-log-level", dest="log_level", type=str.lower, choices=shared.LOG_LEVELS,
                   help="vLLM's name for --log-level")
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    from tandem.model_source import resolve_model

    if args.enable_auto_tool_choice and args.tool_call_parser is None:  # (vLLM refuses it too)
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME: the markup tool calls are read in")

    return GatewayConfig(verifier=args.verifier, model_dir=resolve_model(args.model_dir, flag="--model-dir", weights=False), host=args.host, port=args.port,
                         grpc_port=args.grpc_port,
                         served_model_name=args.served_model_name[0] if args.served_model_name else None,
                         served_model_aliases=tuple(args.served_model_name[1:]) if args.served_model_name else (),
                         otlp_endpoint=args.otlp_endpoint, max_tokens_limit=args.max_tokens_limit,
                         api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None,
                         max_body_bytes=args.max_body_bytes, max_concurrent_requests=args.max_concurrent_requests,
                         max_queue_wait_s=args.max_queue_wait_s,
                         max_connections_per_address=args.max_connections_per_address,
                         verifier_metrics_url=args.verifier_metrics_url, drafter_metrics_url=args.drafter_metrics_url,
                         generation_config=args.generation_config,
                         log_requests=args.log_requests, log_requests_level=args.log_requests_level,
                         keep_alive_s=args.timeout_keep_alive, chat_template=args.chat_template,
                         internal_secret=internal_secret.load(args.internal_secret_file),
                         access_log=not args.disable_uvicorn_access_log,
                         max_message_interval_ms=args.max_message_interval_ms, metrics_prefix=args.metrics_prefix,
                         upstream_streams=args.upstream_streams, tool_call_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser)
