"""What closes the drafter's internal plane (docs/architecture.md, "Contracts"): the shared secret every
Rounds and Reload call must present (tandem.internal_secret; UNAUTHENTICATED otherwise), one verifier stream
at a time, and the folder Reload may load from."""

from __future__ import annotations

import asyncio
import logging
import os

import grpc

from tandem import internal_secret
from tandem.log_limit import LimitedLog

log = logging.getLogger("drafter.service")
_refusals = LimitedLog(log)
# A new stream waits this long for the previous one's handler to end (a verifier reconnecting right after
# its stream broke) before it is refused as a second verifier.
PREVIOUS_STREAM_WAIT_S = 2.0


class InternalPlaneGuard:
    def __init__(self, secret: str | None, reload_root: str):
        """``secret``: None lets every caller in (a loopback-only drafter, DrafterServiceConfig)."""
        self.secret = secret
        self.reload_root = os.path.realpath(reload_root)
        self._stream_ended: asyncio.Event | None = None  # the serving stream's; set when its handler ends

    async def authenticate(self, context: grpc.aio.ServicerContext) -> None:
        if not internal_secret.matches(self.secret, context.invocation_metadata()):
            internal_secret.log_refused(_refusals, context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this drafter serves its verifier only")

    async def claim_stream(self) -> asyncio.Event | None:
        """The new stream's end-of-handler event (its handler must set it), once no other stream is
        served; None if one still is after PREVIOUS_STREAM_WAIT_S."""
        deadline = asyncio.get_running_loop().time() + PREVIOUS_STREAM_WAIT_S
        while self._stream_ended is not None and not self._stream_ended.is_set():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._stream_ended.wait(), left)
            except asyncio.TimeoutError:
                return None
        self._stream_ended = asyncio.Event()  # no await since the check: two new streams cannot both pass
        return self._stream_ended

    def below_root(self, draft_model: str) -> str | None:
        """The real path of ``draft_model`` if it is a folder strictly below the reload root, else None."""
        real = os.path.realpath(draft_model)
        if real == self.reload_root or os.path.commonpath([real, self.reload_root]) != self.reload_root:
            return None
        return real if os.path.isdir(real) else None
