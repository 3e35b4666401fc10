"""MessagePace: how far apart the verifier is asked to send one stream's messages, from how far behind this gateway's
event loop runs.

Every message from the verifier costs the gateway about the same whatever it carries — a gRPC read, a text delta, an
SSE event: ~100 µs of CPU on a small host (bench/gateway_messages.py) — and gRPC's flow control does not push back on
a stream of small messages (a server writes thousands before a write blocks). So at high concurrency on a fast target,
where plain decoding sends one message a request a step, the gateway's loop, not the engine, bounds what clients get:
the demo pair over REST at concurrency 64 served target-only at ~25k tok/s with the gateway at 1.25 CPU, while the
same stack speculating (a round's tokens in one message) had it at 0.9.

Two readings say when, sampled every ``sample_every_s`` and averaged over about ``window`` samples: the share of the
wall time the loop's thread spent on the CPU (from ``busy_floor`` on, the interval asked for grows in proportion, to
``most_s`` at a loop that never rests), and the loop's lag (a callback asked for at once runs as late as the work
queued ahead of it; on a host whose cores are all taken the loop falls behind without being busy itself): from
``floor_s`` on, ``ratio`` lags. The larger is asked of the verifier (GenerateRequest.message_interval_us, set on each
new generation): it sends a stream's tokens at most that often, those that come sooner together. A loop that keeps up
asks for nothing: every step's tokens go as they come.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PaceConfig:
    most_s: float = 0.05  # the longest interval asked for (GatewayConfig.max_message_interval_ms; 0: never pace)
    busy_floor: float = 0.5  # a loop busy this share of the time or less asks for nothing (by its CPU) ...
    floor_s: float = 0.001  # ... nor one whose mean lag is below this
    ratio: float = 2.0  # the interval asked for, in lags
    sample_every_s: float = 0.01  # how often the lag is sampled ...
    idle_every_s: float = 0.1  # ... and while the last sample found the loop keeping up (an idle gateway's CPU)
    window: int = 16  # samples: the mean lag decays over about this many


class MessagePace:
    def __init__(self, cfg: PaceConfig = PaceConfig(), clock: Callable[[], float] = time.perf_counter):
        self.cfg, self.clock = cfg, clock
        self.lag_s = 0.0  # the mean lag of the loop
        self.busy = 0.0  # the mean share of the wall time its thread spent on the CPU

    def observe(self, lag_s: float, busy: float) -> None:
        keep = 1 - 1 / self.cfg.window
        self.lag_s = keep * self.lag_s + (1 - keep) * lag_s
        self.busy = keep * self.busy + (1 - keep) * busy

    def interval_us(self) -> int:
        """GenerateRequest.message_interval_us for a generation starting now."""
        c = self.cfg
        if c.most_s <= 0:
            return 0
        by_lag = c.ratio * self.lag_s if self.lag_s >= c.floor_s else 0.0
        by_busy = c.most_s * max(0.0, self.busy - c.busy_floor) / (1 - c.busy_floor)
        return round(1e6 * min(max(by_lag, by_busy), c.most_s))

    async def run(self) -> None:
        """Sample the running loop's lag until cancelled."""
        if self.cfg.most_s <= 0:
            return
        c, loop = self.cfg, asyncio.get_running_loop()
        wall, cpu = self.clock(), time.thread_time()  # (this thread's: the loop's)
        every = c.sample_every_s
        while True:
            await asyncio.sleep(every)
            asked, lag = self.clock(), loop.create_future()
            loop.call_soon(lambda: lag.done() or lag.set_result(self.clock() - asked))
            lag_s = await lag
            now, cpu_now = self.clock(), time.thread_time()
            busy = min(1.0, (cpu_now - cpu) / max(now - wall, 1e-9))
            # a slower sample counts as the samples its time holds, so the means decay at the same pace per second
            for _ in range(max(1, round(every / c.sample_every_s))):
                self.observe(lag_s, busy)
            wall, cpu = now, cpu_now
            every = c.idle_every_s if lag_s < c.floor_s and busy <= c.busy_floor else c.sample_every_s
