"""Start the verifier: engine (and its TP ranks), drafter connection, engine loop, gRPC server.

gRPC health says NOT_SERVING until the model is loaded and the loop runs, and again while draining.
SIGTERM/SIGINT stop accepting, let in-flight streams finish for a grace period, stop the TP ranks,
and unlink the shared-memory ring; during the model's load they stop the start at once. The engine loop runs on a thread of this process, or with
``--engine-process`` in a process of its own (verifier/engine_process.py), which then also serves the metrics.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem import tracing
from tandem.service_runtime import (GRPC_SERVER_OPTIONS, host_port, listen, report_hangs_in_health, set_health,
                                    stop_on_signals, wait_for_stop)
from tandem.configs.model import ModelConfig
from verifier.config import IN_PROCESS, VerifierConfig
from verifier.engine_build import build_engine, take_down
from verifier.engine_api import EngineFailed
from verifier.engine_loop import EngineLoop
from verifier import generate_many
from verifier.engine_process import EngineProcess
from verifier.metrics import VerifierMetrics
from verifier.stats_line import StatsLine
from verifier.server import SERVICE, VerifierService

log = logging.getLogger("verifier")


def engine_loop(cfg: VerifierConfig, on_fatal) -> EngineLoop:
    """The engine loop on a thread of this process, with its metrics (served here where a port is set)."""
    metrics = VerifierMetrics(max_positions=cfg.num_draft_tokens, model_name=cfg.model_name)
    if cfg.metrics_port is not None:
        metrics.serve(cfg.metrics_port, cfg.host)
    return EngineLoop(lambda: build_engine(cfg, metrics), metrics, cfg.max_waiting, on_fatal,
                      StatsLine(cfg.log_stats_interval_s, speculative=cfg.drafter is not None), cfg.trace_rounds)


async def serve(cfg: VerifierConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    server = grpc.aio.server(options=[*GRPC_SERVER_OPTIONS,
                                      ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000)])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await set_health(health_servicer, SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    report_hangs_in_health(health_servicer, asyncio.get_running_loop())
    service = VerifierService(cfg, ModelConfig.from_dir(cfg.engine.model), speculative=cfg.drafter is not None)
    server.add_generic_rpc_handlers([service.handler(GenerateMany=generate_many.method_handler(service))])
    if cfg.internal_secret is None:
        log.warning("no internal secret (tandem.internal_secret): any local process may call this verifier directly, "
                    "past the gateway's API key and limits; `tandem up` and compose set one")
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = listen(server, host_port(cfg.host, cfg.port))
    await server.start()  # health answers NOT_SERVING (and Generate UNAVAILABLE) while the model loads
    log.info("loading %s (tp=%d, %s)", cfg.engine.model, cfg.engine.tp_size, cfg.engine.device)

    aio_loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    stop_on_signals(stop)  # (a Ctrl-C while the model loads stops the start)

    def on_fatal(error: BaseException) -> None:  # the engine loop died: probes see it, new requests are refused,
        asyncio.run_coroutine_threadsafe(  # and the service drains and exits non-zero (EngineFailed) to be restarted
            set_health(health_servicer, SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING), aio_loop)
        aio_loop.call_soon_threadsafe(stop.set)

    loop = EngineProcess(cfg, on_fatal, build_engine) if cfg.engine_process else engine_loop(cfg, on_fatal)
    loop.start()  # loads the model on its own thread, then steps it there
    try:
        built = await _built_unless_stopped(loop, stop)
    except asyncio.CancelledError:  # the loop shuts down what it built once the load ends
        loop.stop()
        raise
    except Exception:  # the load failed: the server stops while its event loop runs (else grpc's __del__ raises later)
        await server.stop(0)
        loop.join(timeout=30)  # (an engine process ends by itself after a failed start)
        raise
    if built is _STOPPED:  # (the loop shuts down what it built once the load ends; a child process is ended)
        log.info("stopped while loading")
        loop.stop()
        await server.stop(0)
        loop.join(timeout=0)  # (a load cannot be waited for: an engine process is killed, a thread left to the exit)
        tracing.shutdown_tracing()
        raise StoppedWhileLoading()
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
    service.drain()  # (GenerateMany's open streams refuse new starts, as the server refuses new calls)
    await server.stop(grace=5.0)
    loop.stop()
    loop.join(timeout=10)
    if built is not None:  # (an engine process takes its own down)
        take_down(built, stepping=loop.is_alive())
    tracing.shutdown_tracing()
    if loop.fatal is not None:
        raise EngineFailed(loop.fatal)


_STOPPED = object()


class StoppedWhileLoading(Exception):
    """serve() stopped before its engine was built: the load goes on in its thread, which nothing can stop, so the
    process ends at once (``python -m verifier``); torch's threads abort an interpreter's exit under a running load."""


async def _built_unless_stopped(loop, stop: asyncio.Event):
    """What the engine loop built, or ``_STOPPED`` where ``stop`` came first (the load itself cannot be interrupted:
    the loop's thread discards what it built, an engine process is ended)."""
    built = asyncio.ensure_future(asyncio.shield(asyncio.wrap_future(loop.built)))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({built, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if built.done():
        return built.result()
    built.cancel()
    return _STOPPED

