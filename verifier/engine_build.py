"""Building the verifier's engine: the target (and its TP ranks), the drafter's side (the head in process, or the client
of a drafter service with its shared-memory ring and round mailbox), the warm-up before SERVING; and taking it down.
Run on the thread that then steps the engine (verifier/engine_loop.py), in the service's process or in a process of
its own (verifier/engine_process.py)."""

from __future__ import annotations

import dataclasses
import logging

from tandem.service_runtime import freeze_startup_heap
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.warmup import warm_up
from tandem.configs.model import ModelConfig
from tandem.configs.eagle3 import DraftConfig, validate_draft
from tandem.ring import CUDA_IPC, HiddenRing
from tandem.ring.stream_flags import StreamFlagsError
from tandem.speculative.round_mailbox import MailboxLayout, RoundMailbox
from tandem.rpc.drafter.v1 import drafter_pb2
from tandem.speculative.spec_config import SpecConfig
from tandem.speculative.policy import PolicyConfig, SpeculationPolicy
from tandem.engine.speculative_setup import speculative_engine, verify_widths
from verifier.config import IN_PROCESS, IN_PROCESS_MAX_TOPK, VerifierConfig
from verifier.drafter_client import DrafterClient
from verifier.in_process_head import GuardedHead
from verifier.metrics import VerifierMetrics

log = logging.getLogger("verifier")
DRAFTER_WAIT_BEFORE_WARMUP_S = 60.0  # a drafter starting beside the verifier loads and captures its graphs meanwhile


def build_engine(cfg: VerifierConfig, metrics: VerifierMetrics) -> tuple[LLMEngine, DrafterClient | None, HiddenRing | None]:
    if cfg.capture_traffic is not None:
        # Every step's features are kept, drafter or not: graphs must output them; and every prompt token's,
        # so no prompt may start on cached KV (a sample with a hole is dropped).
        if cfg.engine.enable_prefix_caching:
            log.info("--capture-traffic: prefix caching is off (a captured sample needs every token's features)")
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, graph_decode_features=True,
                                                                  enable_prefix_caching=False))
    built = engine, client, ring = _engine_and_drafter(cfg, metrics)
    try:
        if client is not None:
            client.start()
        if engine.executor.runner.graphs is not None:  # on a GPU: compile, launch and time before SERVING
            if client is not None and not client.wait_connected(DRAFTER_WAIT_BEFORE_WARMUP_S):
                log.warning("the drafter did not connect within %.0f s: warming up without it",
                            DRAFTER_WAIT_BEFORE_WARMUP_S)
            warm_up(engine)
            from tandem.kernels.compile_watch import watch_compiles  # (the GPU path's: imports triton)

            watch_compiles()  # a kernel compiled from now on is a first use a request pays for: logged
            freeze_startup_heap()
        if cfg.capture_traffic is not None:
            engine.traffic = _traffic_recorder(cfg, engine)
    except BaseException:  # (the TP ranks, the ring and the connection go with the failed start)
        take_down(built, stepping=False)
        raise
    return built


def _traffic_recorder(cfg: VerifierConfig, engine: LLMEngine):
    from tandem.traffic.dataset import TrafficManifest
    from tandem.traffic.recorder import CaptureConfig, TrafficRecorder

    runner, mc = engine.executor.runner, engine.model_config
    manifest = TrafficManifest(target_model=cfg.engine.model, hidden_size=mc.hidden_size, vocab_size=mc.vocab_size,
                               capture_layers=tuple(runner.capture_layers),
                               feature_width=len(runner.capture_layers) * mc.hidden_size,
                               dtype=str(runner.dtype).removeprefix("torch."))
    return TrafficRecorder(CaptureConfig(cfg.capture_traffic, cfg.capture_traffic_max_gb), manifest)


def _engine_and_drafter(cfg: VerifierConfig, metrics: VerifierMetrics) -> tuple[LLMEngine, DrafterClient | None, HiddenRing | None]:
    if cfg.drafter is None:
        return LLMEngine(cfg.engine), None, None
    spec = SpecConfig(cfg.num_steps, cfg.topk, cfg.num_draft_tokens)  # validates the flags before loading
    policy = SpeculationPolicy(PolicyConfig(enabled=cfg.speculation_policy == "measured"))
    if cfg.drafter == IN_PROCESS:  # the head beside the target: no ring, no rounds to send (tandem.engine.speculative_setup)
        engine = speculative_engine(cfg.engine, cfg.draft_model, spec, draft_dtype=cfg.engine.dtype, policy=policy,
                                    max_topk=IN_PROCESS_MAX_TOPK)
        engine.proposer = GuardedHead(engine.proposer)
        metrics.drafter_up.set(1)
        return engine, None, None
    # verification graphs take the tree width (and each shorter chain's); decode graphs serve requests that do not
    # speculate
    engine_cfg = dataclasses.replace(cfg.engine, cuda_graph_widths=verify_widths(policy.ladder(spec)))
    if cfg.draft_model is not None:  # validate the pair before anything is allocated
        capture = validate_draft(DraftConfig.from_dir(cfg.draft_model), ModelConfig.from_dir(engine_cfg.model),
                                 engine_cfg.capture_layers)
        engine_cfg = dataclasses.replace(engine_cfg, capture_layers=capture)
    engine = LLMEngine(engine_cfg, policy=policy)
    try:
        return _drafter_client(cfg, metrics, engine, spec)
    except BaseException:  # (its TP ranks go with the failed start)
        engine.shutdown()
        raise


def _drafter_client(cfg: VerifierConfig, metrics: VerifierMetrics, engine: LLMEngine,
                    spec: SpecConfig) -> tuple[LLMEngine, DrafterClient, HiddenRing]:
    """The ring, the round mailbox and the client of the drafter service, beside ``engine``."""
    runner, engine_cfg = engine.executor.runner, engine.cfg
    mc = engine.model_config
    ring = HiddenRing.create(cfg.ring_rows, len(runner.capture_layers) * mc.hidden_size, runner.dtype, runner.device)
    target = drafter_pb2.TargetInfo(model=cfg.engine.model, hidden_size=mc.hidden_size, vocab_size=mc.vocab_size,
                                    kv_tokens=engine.allocator.capacity_pages * engine_cfg.page_size,
                                    num_layers=mc.num_layers, capture_layers=list(runner.capture_layers))

    def on_state(up: bool) -> None:
        metrics.drafter_round_lane.set(1 if up and client.rounds_on_lane else 0)  # before drafter_up: probes wait on it
        metrics.drafter_up.set(1 if up else 0)
        if not up:
            metrics.drafter_failures.inc()

    client = DrafterClient(cfg.drafter, ring, target, cfg.drafter_deadline_s, cfg.reconnect_interval_s, on_state,
                           metrics.observe_drafter_round, round_lane=cfg.round_lane, prefetch=cfg.round_prefetch,
                           mailbox=_round_mailbox(engine, spec, ring), secret=cfg.internal_secret)
    engine.proposer, engine.default_spec = client, spec
    return engine, client, ring


def _round_mailbox(engine: LLMEngine, spec: SpecConfig, ring: HiddenRing) -> RoundMailbox | None:
    """The mailbox for runs of chain rounds queued on the device with the drafter (GPU, graphs, one
    rank, greedy chains, several rounds per step); None where runs cannot apply."""
    graphs = engine.executor.runner.graphs
    if (graphs is None or ring.spec.kind != CUDA_IPC or engine.cfg.tp_size > 1 or spec.topk != 1
            or engine.spec_rounds <= 1):
        return None
    layout = MailboxLayout(graphs.max_bs, spec.num_draft_tokens, ring.spec.row_width, ring.spec.torch_dtype)
    try:
        return RoundMailbox.create(layout, ring.tensor.device)
    except StreamFlagsError as e:  # (the pair serves on, drafting one round a step)
        log.warning("runs of chain rounds with the drafter are off: %s", e)
        return None


def take_down(built, stepping: bool) -> None:
    """Close what ``build_engine`` made once its loop has stopped: the drafter client, the traffic recorder, the engine
    (``stepping``: a step still running keeps its model and pool) and the ring."""
    engine, client, ring = built
    if client is not None:
        client.close()
    if engine.traffic is not None:
        engine.traffic.close()
    engine.shutdown(release=not stepping)
    if ring is not None:
        ring.close()
