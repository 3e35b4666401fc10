"""Every service's gRPC server refuses a port another process listens on (tandem.service_runtime): gRPC's default on
Linux (SO_REUSEPORT) lets a second server bind it silently, each new connection then going to either process — a
stale verifier would take half of a new one's traffic."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.errors import TandemError
from tandem.service_probe import free_port
from tandem.service_runtime import GRPC_SERVER_OPTIONS, listen


def test_a_second_server_on_a_taken_port_is_refused_with_one_clear_error():
    async def main():
        port = free_port()
        first = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
        assert listen(first, f"127.0.0.1:{port}") == port
        await first.start()
        try:
            with pytest.raises(TandemError, match=f"cannot listen on 127.0.0.1:{port}: the port is in use"):
                listen(grpc.aio.server(options=GRPC_SERVER_OPTIONS), f"127.0.0.1:{port}")
        finally:
            await first.stop(None)

    asyncio.run(main())
