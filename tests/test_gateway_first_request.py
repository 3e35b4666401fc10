"""What the first request after the gateway says ready would otherwise pay for (gateway/warmup.py, the health
mirror in gateway/server.py, gateway/__main__.py): anyio's asyncio backend, loaded by a streamed response's task
group, is loaded before ``start()`` returns; the process freezes its start-up heap before it serves; the
verifier's model info is cached before ``/health`` says serving."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

from fake_verifier import start_fake_verifier
from gateway_harness import tiny_model_dir, vocab_size

from gateway.config import GatewayConfig
from gateway.server import Gateway

# The gateway's process as ``python -m gateway`` runs it (gateway.__main__.serve), up to where it would serve:
# is anyio's backend loaded (before start, after it), is the start-up heap frozen.
_STARTED_PROCESS = textwrap.dedent("""
    import gc, sys, uvloop
    from gateway.__main__ import serve
    from gateway.config import GatewayConfig
    from gateway.server import Gateway

    gw = Gateway(GatewayConfig(verifier="127.0.0.1:1", model_dir=sys.argv[1], port=0, grpc_port=0,
                               shutdown_grace_s=0.5))
    print("anyio._backends._asyncio" in sys.modules)

    async def wait():
        print("anyio._backends._asyncio" in sys.modules, gc.get_freeze_count() > 0)

    gw.wait = wait
    uvloop.run(serve(gw))
""")


def test_streaming_backend_loaded_and_heap_frozen_before_serving():
    # A fresh process: the test process has long imported anyio's backend (pytest plugins, httpx).
    out = subprocess.run([sys.executable, "-c", _STARTED_PROCESS, str(tiny_model_dir())], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True"], out.stdout


def test_model_info_cached_before_serving():
    async def main() -> None:
        server, _, port = await start_fake_verifier(vocab_size())
        gw = Gateway(GatewayConfig(verifier=f"127.0.0.1:{port}", model_dir=str(tiny_model_dir()), port=0, grpc_port=0,
                                   health_poll_s=0.1, upstream_timeout_s=1.0, shutdown_grace_s=0.5))
        try:
            await gw.start()
            async with asyncio.timeout(10):
                while not gw.client.serving:  # looked at on every turn of the loop the mirror runs on
                    await asyncio.sleep(0)
            assert gw.client.known_info is not None
        finally:
            await gw.stop()
            await server.stop(0)

    import uvloop

    uvloop.run(main())
