"""The running gateway: the REST app on uvicorn and the gRPC server on one event loop, the verifier
channel they share, and the task that mirrors the verifier's health into ours."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from gateway.config import GatewayConfig
from gateway.context import GatewayContext
from gateway.errors import GatewayError
from gateway.grpc_api import build_grpc_server, set_serving
from gateway.http_protocol import http_protocol
from gateway.metrics_relay import MetricsRelay
from gateway.openai_api import create_app
from gateway.openai_shapes import CUT_SHORT_SEND_S
from gateway.upstream import VerifierClient
from gateway.warmup import warm_up_streaming
from tandem.args import API_KEY_ENV
from tandem.service_runtime import check_can_listen, host_port

log = logging.getLogger("gateway")


class _GraceOverIsAWarning(logging.Filter):
    """uvicorn logs the end of its graceful shutdown's wait as an ERROR; here it is the expected path of a stop with
    streams still running (each is then ended with an event telling its client to retry): a WARNING, said so."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and "timeout graceful shutdown exceeded" in str(record.msg):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = ("shutdown: the grace period is over; %s request(s) still running are cut short "
                                       "(each client is told to retry)"), record.args
        return True


logging.getLogger("uvicorn.error").addFilter(_GraceOverIsAWarning())
STOP_POLL_S = 0.05  # how soon the gRPC API starts draining once uvicorn was told to stop


class Gateway(GatewayContext):
    """``await start()`` binds both ports (0 picks free ones, then ``port``/``grpc_port`` say
    which); ``await wait()`` returns when the HTTP server has exited (SIGINT/SIGTERM or
    ``request_stop()``); ``await stop()`` drains and closes everything."""

    def __init__(self, cfg: GatewayConfig):
        super().__init__(cfg)
        self.port = self.grpc_port = 0
        self._http: uvicorn.Server | None = None
        self._grpc = self._health = None
        self._tasks: list[asyncio.Task] = []
        self._stop_requested = False  # request_stop was called (a signal before uvicorn took them, a test, stop())
        self._grpc_drain: asyncio.Task | None = None

    async def start(self) -> None:
        cfg = self.cfg
        check_can_listen(cfg.host, (cfg.port, cfg.grpc_port))  # (one line for either, before gRPC's own log of it)
        self.client = VerifierClient(cfg.verifier, cfg.upstream_timeout_s, cfg.internal_secret,
                                     message_interval_us=self.pace.interval_us,
                                     one_stream=cfg.upstream_streams == "one")
        self.metrics_relays = [MetricsRelay(service, url, cfg.verifier_metrics_timeout_s, self.metrics.names())
                               for service, url in (("verifier", cfg.verifier_metrics_url),
                                                    ("drafter", cfg.drafter_metrics_url)) if url is not None]
        self._grpc, self.grpc_port, self._health = build_grpc_server(self, host_port(cfg.host, cfg.grpc_port))
        if self.grpc_port == 0:
            raise OSError(f"cannot listen for gRPC on {host_port(cfg.host, cfg.grpc_port)}")
        await set_serving(self._health, False)
        await self._grpc.start()
        self._grpc_drain = asyncio.create_task(self._drain_grpc(), name="gateway-grpc-drain")

        # Bind the HTTP socket ourselves so that port 0 works and the real port is known before
        # uvicorn starts (its own logs only say what it was asked).
        bare = cfg.host.strip("[]")
        sock = socket.create_server((bare, cfg.port), family=socket.AF_INET6 if ":" in bare else socket.AF_INET)
        self.port = sock.getsockname()[1]
        app = create_app(self)
        await warm_up_streaming()  # the first streamed request must not import anyio's backend (gateway/warmup.py)
        self._http = uvicorn.Server(uvicorn.Config(app, lifespan="off", access_log=cfg.access_log, log_config=None,
                                                   timeout_graceful_shutdown=int(cfg.shutdown_grace_s),
                                                   timeout_keep_alive=cfg.keep_alive_s,
                                                   http=http_protocol(cfg.max_connections_per_address),
                                                   ws="none"))  # (no websocket routes: an upgrade is a plain request)
        self._http.should_exit = self._stop_requested  # (told to stop before it existed: it stops at once)
        http_task = asyncio.create_task(self._http.serve(sockets=[sock]), name="gateway-http")
        while not self._http.started:
            if http_task.done():
                http_task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server exited during start-up")
            await asyncio.sleep(0.01)
        # The first health check before "ready": generations are refused while the verifier is not seen SERVING
        serving = await self._check_health(None)
        self._tasks = [http_task, asyncio.create_task(self._mirror_health(serving), name="gateway-health"),
                       asyncio.create_task(self.pace.run(), name="gateway-pace")]
        log.info("gateway ready: OpenAI API at http://%s/v1 and gRPC Generation at %s (model %s, verifier %s)",
                 host_port(cfg.host, self.port), host_port(cfg.host, self.grpc_port), cfg.model_name, cfg.verifier)
        if cfg.open_to_all:
            log.warning("the OpenAI and gRPC APIs on %s serve anyone who reaches them: no --api-key (or $%s) is set",
                        cfg.host, API_KEY_ENV)

    async def _mirror_health(self, serving: bool | None) -> None:
        """Our gRPC health is the verifier's: a load balancer should not send work we cannot do."""
        while True:
            await asyncio.sleep(self.cfg.health_poll_s)
            serving = await self._check_health(serving)

    async def _check_health(self, serving: bool | None) -> bool:
        """One look at the verifier's health (``serving``: what the last one found); → whether it is SERVING."""
        try:
            ok = await self.client.healthy()
        except Exception:  # never let the mirror die: it is the only thing that flips us back
            log.exception("health check of the verifier failed")
            ok = False
        if ok:  # the model info cached before we say serving, so that the first request does not wait on it
            try:
                await self.client.model_info()
            except GatewayError:  # (unreachable since, or it refuses us: logged by the client)
                ok = False
            except Exception:
                log.exception("the verifier's model info")
        self.client.serving = ok
        self.client.failed_checks = 0 if ok else self.client.failed_checks + 1
        if ok != serving:
            await set_serving(self._health, ok)
            log.info("verifier %s is %s", self.cfg.verifier, "serving" if ok else "not serving")
        return ok

    @property
    def shutting_down(self) -> bool:
        return self._stop_requested or (self._http is not None and self._http.should_exit)

    def request_stop(self) -> None:
        """Stop taking work and drain (a signal handler's or another thread's call too: it only sets flags)."""
        self._stop_requested = True
        if self._http is not None:
            self._http.should_exit = True

    async def _drain_grpc(self) -> None:
        """Once told to stop: the public gRPC API takes no new calls and its generations get the grace period, as REST's
        do and at the same time (after REST's, they had twice as long and new calls were taken meanwhile); those still
        running shortly before it ends are ended UNAVAILABLE, a status clients retry (the server's own cancel at the end
        would reach them as CANCELLED, which reads as their own)."""
        # (uvicorn takes SIGINT/SIGTERM from our handlers while it serves and only sets its should_exit: both are watched)
        while not self.shutting_down:
            await asyncio.sleep(STOP_POLL_S)
        await self._health.enter_graceful_shutdown()
        grace = self.cfg.shutdown_grace_s
        stopping = asyncio.ensure_future(self._grpc.stop(grace))
        _, running = await asyncio.wait({stopping}, timeout=grace - min(CUT_SHORT_SEND_S, grace / 2))
        if running:
            self.grpc_cut_short = True
            for task in list(self.grpc_streams):
                task.cancel()
        await stopping

    async def wait(self) -> None:
        if self._tasks:
            await self._tasks[0]

    async def stop(self) -> None:
        """Refuse new work, let streams in flight finish for up to the grace period, then close."""
        self.request_stop()
        if self._tasks:
            with contextlib.suppress(Exception):
                await self._tasks[0]
            for task in self._tasks[1:]:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                except Exception:  # (logged; the drain and the client's close still run)
                    log.exception("%s failed", task.get_name())
        if self._grpc_drain is not None:
            await self._grpc_drain
        elif self._grpc is not None:  # (stopped before it had started)
            await self._grpc.stop(0)
        if self.client is not None:
            await self.client.close()
