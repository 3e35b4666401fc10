"""Start the drafter: load and validate the EAGLE-3 head, then serve the Rounds stream.

gRPC health says NOT_SERVING until the head is loaded (and, with CUDA graphs, captured).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem import tracing
from tandem.round_lane import MAX_FRAME_BYTES
from tandem.service_runtime import (GRPC_SERVER_OPTIONS, freeze_startup_heap, host_port, listen,
                                    report_hangs_in_health, set_health, wait_for_stop)
from tandem.configs.model import ModelConfig
from tandem.rpc.drafter.v1 import drafter_pb2_grpc
from tandem.speculative.drafter import Eagle3Drafter
from drafter.config import DrafterServiceConfig
from drafter.metrics import DrafterMetrics
from drafter.profiling import RoundProfiler
from drafter.service import SERVICE, DrafterService
from drafter.verifier_watch import VerifierWatch

log = logging.getLogger("drafter")


async def serve(cfg: DrafterServiceConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    server = grpc.aio.server(options=[*GRPC_SERVER_OPTIONS,
                                      # a Round as large as the round lane takes (requests starting on long prefixes)
                                      ("grpc.max_receive_message_length", MAX_FRAME_BYTES),
                                      ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                                      ("grpc.http2.max_ping_strikes", 0),
                                      # A verifier that vanished without closing its connection (a hung host,
                                      # a cut link) ends its stream within ~15 s, so its restart is not refused
                                      # as a second verifier (DrafterService: one stream at a time).
                                      ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                                      ("grpc.keepalive_permit_without_calls", 1),
                                      ("grpc.http2.max_pings_without_data", 0)])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await set_health(health_servicer, SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    report_hangs_in_health(health_servicer, asyncio.get_running_loop())
    log.info("loading draft %s for target %s", cfg.draft_model, cfg.target_model)
    # Loaded on this thread, which then runs the rounds (on its event loop): on CPU, torch's intra-op
    # threads of a loading thread and of a serving thread fight over the cores and slow it down.
    # Nothing is served meanwhile: the server starts below.
    drafter = Eagle3Drafter.from_dirs(cfg.draft_model, cfg.target_model, cfg.runtime)
    if cfg.graph_specs:  # health stays NOT_SERVING until the draft and draft-extend graphs are captured
        drafter.capture_cuda_graphs(list(cfg.graph_specs))
        freeze_startup_heap()
    profiler = RoundProfiler(cfg.profile_rounds, cfg.profile_dir)
    metrics = DrafterMetrics()
    if cfg.metrics_port is not None:
        metrics.serve(cfg.metrics_port, cfg.host)
    watch = VerifierWatch(cfg.exit_without_verifier_s) if cfg.exit_without_verifier_s else None
    service = DrafterService(drafter, cfg.draft_model, cfg.target_model, ModelConfig.from_dir(cfg.target_model).hidden_size,
                             cfg.runtime, cfg.graph_specs, cfg.lane_busy_poll_ms / 1e3, profiler,
                             secret=cfg.internal_secret, reload_root=cfg.reload_root or None, metrics=metrics,
                             watch=watch)
    if cfg.internal_secret is None:
        log.warning("no internal secret (tandem.internal_secret): any local process may drive this drafter; "
                    "`tandem up` and compose set one")
    drafter_pb2_grpc.add_DrafterServicer_to_server(service, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = listen(server, host_port(cfg.host, cfg.port))
    await server.start()
    await set_health(health_servicer, SERVICE, health_pb2.HealthCheckResponse.SERVING)
    log.info("drafter serving on %s", host_port(cfg.host, port))
    if ready is not None:
        ready.set()
    stop = stop or asyncio.Event()
    watching = asyncio.create_task(watch.watch(stop)) if watch is not None else None
    await wait_for_stop(stop)
    if watching is not None:
        watching.cancel()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=2.0)
    profiler.close()
    tracing.shutdown_tracing()
    if watch is not None and watch.fired:
        raise watch.error()
