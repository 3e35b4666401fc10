"""What the gateway's two front ends (the OpenAI REST app, the gRPC Generation service) share: the settings,
the tokenizer and chat template, the sampling defaults, admission slots, metrics, the verifier client and
what the health mirror last saw. The running server (gateway/server.py) is one and starts them."""

from __future__ import annotations

import time

from gateway import reasoning, tool_calls
from gateway.admission import BODY_BUDGET_BODIES, BodyBudget, Slots
from gateway.chat_answer import AnswerFormats
from gateway.config import GatewayConfig
from gateway.generation_defaults import SamplingDefaults
from gateway.metrics import GatewayMetrics
from gateway.metrics_relay import MetricsRelay
from gateway.pacing import MessagePace, PaceConfig
from gateway.prompt_bound import PromptBound
from gateway.request_log import RequestLog
from gateway.upstream import VerifierClient
from tandem.chat_template import ChatTemplate
from tandem.tokenizer import load_tokenizer


class GatewayContext:
    def __init__(self, cfg: GatewayConfig):
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.model_dir)
        self.chat_template = ChatTemplate.from_model_dir(cfg.model_dir, cfg.chat_template)
        # what chat answers are read into (--tool-call-parser, --reasoning-parser)
        self.answer_formats = AnswerFormats(tool_calls.FORMATS.get(cfg.tool_call_parser),
                                            reasoning.FORMATS.get(cfg.reasoning_parser))
        self.prompt_bound = PromptBound.of(self.tokenizer)
        self.sampling_defaults = SamplingDefaults.load(cfg.model_dir, cfg.generation_config)
        self.metrics = GatewayMetrics(cfg.model_name)
        self.request_log = RequestLog(cfg.log_requests_level) if cfg.log_requests else None
        self.slots = Slots(cfg.max_concurrent_requests, cfg.max_queue_wait_s)
        self.metrics.watch_queue(lambda: self.slots.queued)
        self.body_budget = BodyBudget(BODY_BUDGET_BODIES * cfg.max_body_bytes)
        self.metrics_relays: list[MetricsRelay] = []  # made at start: their locks bind to the loop
        self.started_at = int(time.time())
        self.client: VerifierClient | None = None  # made at start: gRPC aio objects bind to the running loop
        self.grpc_streams: set = set()  # the public gRPC API's generations in flight (their tasks)
        self.grpc_cut_short = False  # the shutdown's grace period ran out on them: they end UNAVAILABLE
        # how far apart the verifier sends a stream's messages, from this loop's lag (sampled from start)
        self.pace = MessagePace(PaceConfig(most_s=cfg.max_message_interval_ms / 1e3))

    @property
    def shutting_down(self) -> bool:
        """The server is stopping (new connections refused, streams given a grace period)."""
        return False

    @property
    def verifier_ready(self) -> bool:
        """The verifier was SERVING at the last health check, and no generation has found it unavailable since."""
        return self.client is not None and self.client.ready
