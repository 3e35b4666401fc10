"""What every service's process shares: running its asyncio main under uvloop with one-line errors,
and waiting for SIGTERM/SIGINT. Torch-free (the gateway uses it too)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
from typing import Awaitable, Callable

from tandem.errors import TandemError
from tandem.parent_death import signal_on_parent_death

LAUNCHER_PID_ENV = "TANDEM_LAUNCHER_PID"  # set by `tandem up` for the services it starts (tandem.launcher)
# Every service's gRPC server: a port another process listens on is refused, not shared (gRPC's default on Linux,
# SO_REUSEPORT, lets a second server bind it silently, each new connection going to either process).
GRPC_SERVER_OPTIONS = [("grpc.so_reuseport", 0)]


def die_with_launcher() -> None:
    """Linux, in a service started by `tandem up`: get SIGTERM (and stop as on Ctrl-C) when the launcher's thread that
    started it ends, the launcher killed outright included; otherwise a SIGKILLed or OOM-killed `tandem up` leaves its
    services running, holding their ports, GPU memory and shared memory. Set here, by the service, not by the launcher
    between fork and exec: a ``preexec_fn`` makes every start a plain fork, which runs gRPC's fork handlers in the
    child while the launcher's health probes use gRPC, and 3 children in 150 aborted before their exec (grpcio 1.85;
    grpc/grpc#43055). Called first thing in each service's ``main``; the variable is not passed on."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)
    if launcher is None or not signal_on_parent_death(signal.SIGTERM):
        return
    if os.getppid() != int(launcher):  # the launcher died before the signal was asked for
        os._exit(1)


OPEN_FILES_WANTED = 65536  # descriptors a service may hold (each client connection takes one)


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raise this process's soft limit on open descriptors towards ``wanted`` (never past the hard limit, never down), as
    vLLM and SGLang do: at a shell's default of 1024 a few hundred idle client connections left the gateway unable to
    accept any (REST or gRPC). → the soft limit now."""
    try:
        import resource
    except ImportError:  # (not POSIX)
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def run_service(main: Callable[[], Awaitable[None]]) -> int:
    """Run ``main()`` on uvloop (when installed); a TandemError is one ``error:`` line and exit code 2."""
    raise_open_files_limit()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(main())
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def freeze_startup_heap() -> None:
    """Collect what loading, capture and warm-up left, then move every surviving object out of the
    collector's generations (``gc.freeze``): the model's modules, graphs and buffers live as long as the
    process, and without this a full collection walks them all in the middle of a request. Called once,
    before SERVING: by the verifier and the drafter on a GPU (where start-up captures graphs and is long
    anyway), by the gateway's process once it has started."""
    gc.collect()
    gc.freeze()


async def set_health(health_servicer, service: str, status) -> None:
    """Say ``status`` (a HealthCheckResponse status) for the server as a whole and for ``service``."""
    for name in ("", service):
        await health_servicer.set(name, status)


def stop_on_signals(stop: asyncio.Event) -> None:
    """From now on SIGTERM/SIGINT set ``stop``, through the running loop (signals only on the main thread: tests run
    services on other threads and stop them through the event). Also before a long start: Python's own SIGINT
    handler runs only once the loop wakes, and a loop waiting for a model to load did not, for minutes."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass


async def wait_for_stop(stop: asyncio.Event | None) -> None:
    """Return when ``stop`` is set or the process gets SIGTERM/SIGINT (``stop_on_signals``)."""
    stop = stop or asyncio.Event()
    stop_on_signals(stop)
    await stop.wait()


def report_hangs_in_health(health_servicer, loop: asyncio.AbstractEventLoop) -> None:
    """A hung graph capture or replay (the watchdog fires on its own thread) turns gRPC health
    NOT_SERVING before the process exits, so a prober sees it even if the exit is slow."""
    import concurrent.futures

    from tandem.watchdog import on_any_hang

    def hang(what: str) -> None:
        shutdown = health_servicer.enter_graceful_shutdown()
        try:
            future = asyncio.run_coroutine_threadsafe(shutdown, loop)
        except RuntimeError:  # the loop is closed: nothing left to tell
            shutdown.close()
            return
        try:
            future.result(timeout=2)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass

    on_any_hang(hang)


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC and URLs take it: an IPv6 address in brackets (``[::1]:50050``)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def check_can_listen(host: str, ports) -> None:
    """Each of ``ports`` can be bound on ``host`` now, or one clear TandemError (``tandem up`` asks before the models
    load, and must not take another server's answers on a taken port for its own)."""
    import socket

    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET  # (the family the gateway's REST socket takes)
    for port in ports:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the servers bind)
                probe.bind((bare, port))
        except OSError as e:
            raise TandemError(f"cannot listen on {host_port(host, port)}: {e.strerror or e} (another server runs "
                              "there? choose another port)") from None


def listen(server, address: str) -> int:
    """``server.add_insecure_port(address)`` (a server built with GRPC_SERVER_OPTIONS) → the bound port; where the
    address is taken or cannot be bound, one clear error."""
    try:
        return server.add_insecure_port(address)
    except RuntimeError:
        raise TandemError(f"cannot listen on {address}: the port is in use (another service runs there?) or the "
                          "address is not this host's") from None
