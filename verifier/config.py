"""VerifierConfig: every setting of the verifier service, read once from the command line."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields

from tandem import args as shared
from tandem import speculative_flags
from tandem import internal_secret
from tandem.engine.config import EngineConfig
from tandem.errors import ConfigError

ROUND_FEATURE_ROWS = 4096  # the most feature rows one Round carries: more queued extends go out first
# A prefetched Round in flight holds its rows while the next Round's queue up: two Rounds' worth.
MIN_RING_ROWS = 2 * ROUND_FEATURE_ROWS
IN_PROCESS = "in-process"  # --drafter in-process: the head runs inside the verifier, no drafter service
IN_PROCESS_MAX_TOPK = 8  # the largest speculation.topk a request may ask of the in-process head


@dataclass(frozen=True)
class VerifierConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50051
    drafter: str | None = None  # drafter service address; None = no speculation
    draft_model: str | None = None  # the drafter's head: validated here at start-up, sets the capture layers
    num_steps: int = speculative_flags.DEFAULT_NUM_STEPS  # --speculative-num-steps
    topk: int = speculative_flags.DEFAULT_TOPK  # --speculative-eagle-topk
    num_draft_tokens: int = speculative_flags.DEFAULT_NUM_STEPS + 1  # --speculative-num-draft-tokens
    drafter_deadline_s: float = 2.0  # a drafter reply later than this counts as a failure
    reconnect_interval_s: float = 1.0
    ring_rows: int = 65536  # feature rows in the shared-memory ring
    max_waiting: int = 256  # queued requests beyond which new ones get RESOURCE_EXHAUSTED
    metrics_port: int | None = None  # Prometheus endpoint; None = off
    otlp_endpoint: str | None = None
    # per-round spans (draft, verify, accept, draft_extend; the drafter service's drafter.draft) under each traced
    # request: four a request a round, most of a trace's volume — off unless asked for
    trace_rounds: bool = False
    served_model_name: str | None = None
    speculation_policy: str = "measured"  # measured: the batch speculates while it pays (tandem.speculative.policy); always
    capture_traffic: str | None = None  # folder for finished requests' tokens + features (drafter training); None = off
    capture_traffic_max_gb: float = 50.0
    round_lane: bool = True  # offer the drafter a local socket for the per-round messages (tandem/round_lane.py)
    round_prefetch: bool = True  # send the next step's Round at the end of a step (DrafterClient.prefetch)
    # presented to the drafter on its Rounds stream, required of the gateway's calls (tandem.internal_secret)
    internal_secret: str | None = None
    log_stats_interval_s: float = 10.0  # the periodic stats line while busy (verifier/stats_line.py); 0 = off
    # the engine loop in a process of its own, its GIL apart from the gRPC front's (verifier/engine_process.py). None: on
    # where the engine runs on a GPU (faster over REST there, target-only and speculating: docs/benchmarks.md), off on
    # the CPU (a CPU engine's steps are long, the front's share small; the child's spawn and second copy of torch cost
    # start-up and memory there)
    engine_process: bool | None = None

    def __post_init__(self) -> None:
        if self.engine_process is None:
            object.__setattr__(self, "engine_process", self.engine.device.startswith("cuda"))
        if self.drafter == IN_PROCESS:
            if self.draft_model is None:
                raise ConfigError("--drafter in-process runs the EAGLE-3 head inside the verifier: give it "
                                  "--draft-model DIR")
            # Settings of the connection to a drafter service: refused rather than silently ignored.
            service_only = {"drafter_deadline_s": "--drafter-deadline-ms", "reconnect_interval_s": None,
                            "ring_rows": "--ring-rows", "round_lane": "--disable-round-lane",
                            "round_prefetch": "--disable-round-prefetch"}
            given = [flag or name for name, flag in service_only.items()
                     if getattr(self, name) != getattr(VerifierConfig, name)]
            if given:
                raise ConfigError(f"{', '.join(given)}: settings of a drafter service's connection, which "
                                  "--drafter in-process does not have")
        if self.log_stats_interval_s < 0:
            raise ConfigError(f"--log-stats-interval must be >= 0 (0: off), got {self.log_stats_interval_s}")
        if self.ring_rows < MIN_RING_ROWS:
            raise ConfigError(f"--ring-rows must be >= {MIN_RING_ROWS} (a Round in flight and the next one's "
                              f"features), got {self.ring_rows}")

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        e = EngineConfig
        shared.add(p, shared.MODEL, shared.REVISION)
        p.add_argument("--served-model-name", default=None, help="the model's name in metrics (default: the folder's)")
        shared.add(p, shared.TP_SIZE, shared.DEVICE)
        p.add_argument("--page-size", "--block-size", type=int, default=e.page_size, help="tokens per KV page")
        shared.add(p, *shared.ENGINE_FLAGS)
        p.add_argument("--load-format", default=e.load_format, choices=["safetensors", "random", "dummy", "auto"],
                       type=lambda v: {"dummy": "random", "auto": "safetensors"}.get(v, v),
                       help="random (vLLM's dummy): weights drawn on the device, only config.json read (benchmarks); "
                            "auto: safetensors")
        p.add_argument("--host", default=cls.host, help="address the gRPC server binds")
        p.add_argument("--port", type=shared.port, default=cls.port, help="gRPC port")
        p.add_argument("--drafter", default=None,
                       help="drafter service address host:port; 'in-process' to run the --draft-model head inside "
                            "this process (the in-process engine's speed; no drafter isolation or hot reload); "
                            "default: in process where a draft is named (--draft-model, --speculative-algorithm, "
                            "--speculative-config), else no speculation")
        speculative_flags.add_speculative(p, draft_help="the drafter's EAGLE-3 folder: validated against the target at start-up "
                                             "and used to choose the captured layers (recommended with --drafter)")
        p.add_argument("--speculation-policy", choices=["measured", "always"], default=cls.speculation_policy,
                       help="measured: speculate while the batch's accept length beats the measured cost of a round, "
                            "probing now and then; always: every round speculates")
        p.add_argument("--drafter-deadline-ms", type=float, default=cls.drafter_deadline_s * 1000,
                       help="a drafter reply later than this costs the round its speculation")
        p.add_argument("--disable-round-lane", action="store_true",
                       help="send every round on the drafter's gRPC stream instead of the local round lane "
                            "(the lane skips gRPC's threads and wake-ups per round; the stream is the fallback anyway)")
        p.add_argument("--disable-round-prefetch", action="store_true",
                       help="send each Round when the step drafts instead of at the end of the step before "
                            "(prefetching lets the drafter work while the verifier streams and schedules)")
        shared.add(p, shared.INTERNAL_SECRET_FILE)
        p.add_argument("--ring-rows", type=int, default=cls.ring_rows,
                       help=f"feature rows of the shared-memory ring (at least {MIN_RING_ROWS})")
        p.add_argument("--max-waiting-requests", type=int, default=cls.max_waiting,
                       help="queued requests beyond which new ones are refused (RESOURCE_EXHAUSTED)")
        shared.add(p, shared.METRICS_PORT, shared.LOG_LEVEL)
        p.add_argument("--log-stats-interval", type=float, default=cls.log_stats_interval_s, metavar="SECONDS",
                       help="log a stats line (batch, throughput, accept length, KV usage) this often while busy; "
                            "0: off")
        p.add_argument("--disable-log-stats", dest="log_stats_interval", action="store_const", const=0.0,
                       help="vLLM's switch: --log-stats-interval 0")
        shared.add(p, shared.OTLP_ENDPOINT)
        p.add_argument("--trace-rounds", action="store_true",
                       help="also trace each speculative round's phases under its requests (4 spans a request a round)")
        p.add_argument("--capture-traffic", default=None, metavar="DIR",
                       help="append every finished request's tokens and EAGLE-3 features to DIR, for "
                            "python -m drafter.train --traffic DIR (off by default; stores prompts)")
        p.add_argument("--capture-traffic-max-gb", type=float, default=cls.capture_traffic_max_gb,
                       help="stop capturing once DIR holds this much")
        p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                       help="run the engine loop in a process of its own (the gRPC front's work then takes nothing "
                            "from the engine's steps; the metrics port is served from that process); default: on "
                            "with a GPU, off on the CPU")

    @classmethod
    def from_args(cls, a: argparse.Namespace, model: str) -> "VerifierConfig":
        spec = speculative_flags.resolve_speculative(a, model)
        if spec.draft_model == shared.NO_DRAFT:
            spec = dataclasses.replace(spec, draft_model=None)
        spec.require_draft()
        engine = EngineConfig(model=model, device=shared.resolve_device(a.device), tp_size=a.tp_size,
                              page_size=a.page_size, load_format=a.load_format, **shared.engine_settings(a))
        # Asked for as SGLang users do, or by naming a draft alone, speculation without a drafter service runs
        # the head in this process.
        drafter = IN_PROCESS if (spec.requested or spec.draft_model is not None) and a.drafter is None else a.drafter
        return cls(engine=engine, host=a.host, port=a.port, drafter=drafter, draft_model=spec.draft_model,
                   num_steps=spec.num_steps, topk=spec.topk, num_draft_tokens=spec.num_draft_tokens,
                   drafter_deadline_s=a.drafter_deadline_ms / 1000, ring_rows=a.ring_rows,
                   max_waiting=a.max_waiting_requests, metrics_port=a.metrics_port, otlp_endpoint=a.otlp_endpoint,
                   trace_rounds=a.trace_rounds,
                   served_model_name=a.served_model_name, capture_traffic=a.capture_traffic,
                   speculation_policy=a.speculation_policy,
                   capture_traffic_max_gb=a.capture_traffic_max_gb, round_lane=not a.disable_round_lane,
                   round_prefetch=not a.disable_round_prefetch,
                   internal_secret=internal_secret.load_for(a.internal_secret_file, a.host, "the verifier",
                                                            "its gateway (and drafter)"),
                   log_stats_interval_s=a.log_stats_interval, engine_process=a.engine_process)

    @property
    def model_name(self) -> str:
        """The model's name in metrics: as the gateway names it (--served-model-name, else the folder's name)."""
        return shared.served_name(self.engine.model, self.served_model_name)

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                         if f.name not in ("engine", "internal_secret"))  # a secret never goes to a log
