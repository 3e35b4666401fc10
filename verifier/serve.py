"""Start the verifier: engine (and its TP ranks), drafter connection, engine loop, gRPC server.

gRPC health says NOT_SERVING until the model is loaded and the loop runs, and again while draining.
SIGTERM/SIGINT stop accepting, let in-flight streams finish for a grace period, stop the TP ranks,
and unlink the shared-memory ring.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem import tracing
from tandem.service_runtime import (GRPC_SERVER_OPTIONS, freeze_startup_heap, host_port, listen,
                                    report_hangs_in_health, set_health, wait_for_stop)
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.warmup import warm_up
from tandem.configs.model import ModelConfig
from tandem.configs.eagle3 import DraftConfig, validate_draft
from tandem.ring import CUDA_IPC, HiddenRing
from tandem.speculative.round_mailbox import MailboxLayout, RoundMailbox
from tandem.rpc.drafter.v1 import drafter_pb2
from tandem.speculative.spec_config import SpecConfig
from tandem.speculative.policy import PolicyConfig, SpeculationPolicy
from tandem.engine.speculative_setup import speculative_engine, verify_widths
from verifier.config import IN_PROCESS, IN_PROCESS_MAX_TOPK, VerifierConfig
from verifier.drafter_client import DrafterClient
from verifier.engine_loop import EngineFailed, EngineLoop
from verifier.in_process_head import GuardedHead
from verifier.metrics import VerifierMetrics
from verifier.stats_line import StatsLine
from verifier.server import SERVICE, VerifierService

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
    engine, client, ring = _engine_and_drafter(cfg, metrics)
    if client is not None:
        client.start()
    if engine.executor.runner.graphs is not None:  # on a GPU: compile, launch and time before SERVING
        if client is not None and not client.wait_connected(DRAFTER_WAIT_BEFORE_WARMUP_S):
            log.warning("the drafter did not connect within %.0f s: warming up without it", DRAFTER_WAIT_BEFORE_WARMUP_S)
        warm_up(engine)
        from tandem.kernels.compile_watch import watch_compiles  # (the GPU path's: imports triton)

        watch_compiles()  # a kernel compiled from now on is a first use a request pays for: logged
        freeze_startup_heap()
    if cfg.capture_traffic is not None:
        engine.traffic = _traffic_recorder(cfg, engine)
    return engine, client, ring


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
    runner = engine.executor.runner
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
    return RoundMailbox.create(layout, ring.tensor.device)


async def serve(cfg: VerifierConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    metrics = VerifierMetrics(max_positions=cfg.num_draft_tokens, model_name=cfg.model_name)
    if cfg.metrics_port is not None:
        metrics.serve(cfg.metrics_port, cfg.host)
    server = grpc.aio.server(options=[*GRPC_SERVER_OPTIONS,
                                      ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000)])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await set_health(health_servicer, SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    report_hangs_in_health(health_servicer, asyncio.get_running_loop())
    service = VerifierService(cfg, ModelConfig.from_dir(cfg.engine.model), speculative=cfg.drafter is not None)
    server.add_generic_rpc_handlers([service.handler()])
    if cfg.internal_secret is None:
        log.warning("no internal secret (tandem.internal_secret): any local process may call this verifier directly, "
                    "past the gateway's API key and limits; `tandem up` and compose set one")
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = listen(server, host_port(cfg.host, cfg.port))
    await server.start()  # health answers NOT_SERVING (and Generate UNAVAILABLE) while the model loads
    log.info("loading %s (tp=%d, %s)", cfg.engine.model, cfg.engine.tp_size, cfg.engine.device)

    aio_loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()

    def on_fatal(error: BaseException) -> None:  # the engine loop died: probes see it, new requests are refused,
        asyncio.run_coroutine_threadsafe(  # and the service drains and exits non-zero (EngineFailed) to be restarted
            set_health(health_servicer, SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING), aio_loop)
        aio_loop.call_soon_threadsafe(stop.set)

    loop = EngineLoop(lambda: build_engine(cfg, metrics), metrics, cfg.max_waiting, on_fatal,
                      StatsLine(cfg.log_stats_interval_s, speculative=cfg.drafter is not None), cfg.trace_rounds)
    loop.start()  # loads the model on its own thread, then steps it there
    try:
        engine, client, ring = await asyncio.shield(asyncio.wrap_future(loop.built))
    except asyncio.CancelledError:  # the loop shuts down what it built once the load ends
        loop.stop()
        raise
    except Exception:  # the load failed: the server stops while its event loop runs (else grpc's __del__ raises later)
        await server.stop(0)
        raise
    service.attach(loop)
    await set_health(health_servicer, SERVICE, health_pb2.HealthCheckResponse.SERVING)
    log.info("verifier serving on %s%s", host_port(cfg.host, port),
             " (drafter in process)" if cfg.drafter == IN_PROCESS else
             f" (drafter at {cfg.drafter})" if cfg.drafter else " (no drafter: speculation off)")
    if ready is not None:
        ready.set()

    await wait_for_stop(stop)
    log.info("verifier draining")
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=5.0)
    loop.stop()
    loop.join(timeout=10)
    if client is not None:
        client.close()
    if engine.traffic is not None:
        engine.traffic.close()
    engine.shutdown(release=not loop.is_alive())  # (a step still running keeps its model and pool)
    if ring is not None:
        ring.close()
    tracing.shutdown_tracing()
    if loop.fatal is not None:
        raise EngineFailed(f"the engine loop failed: {type(loop.fatal).__name__}: {loop.fatal}")
