"""What the gateway runs once before it says ready, so that the first request does not pay for code's first use.

A streamed response (every ``"stream": true`` completion) runs in an anyio task group, and anyio imports its
asyncio backend (``anyio._backends._asyncio`` and the stream modules it pulls in) on the first task group of
a process: 15-30 ms of imports and class set-up measured on the first streamed request and on no later one.
``warm_up_streaming`` streams one empty response into memory through the same class (task group, disconnect
watch, cancel scope), on the running loop, so the first client's request finds all of it loaded.
"""

from __future__ import annotations

import asyncio

from gateway.openai_shapes import DisconnectAwareStreamingResponse


async def warm_up_streaming() -> None:
    """One empty streamed response, sent nowhere: its body ends at once, which ends the response and cancels
    the disconnect watch (whose ``receive`` never returns)."""

    async def body():
        yield ""

    async def send(message) -> None:
        pass

    async def receive():
        await asyncio.Event().wait()  # no disconnect: the response ends when its body does

    response = DisconnectAwareStreamingResponse(body(), lambda: None, media_type="text/event-stream")
    await response({"type": "http"}, receive, send)
