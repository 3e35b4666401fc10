"""The stand-in engine of bench/verifier_front.py, in a module of its own so that an engine process can import its
builder: each step holds the GIL ``TANDEM_FRONT_BUSY_US`` (the host's work of a step), then releases it
``TANDEM_FRONT_WAIT_US`` (waiting for the device), and gives every running request ``TANDEM_FRONT_TOKENS`` tokens."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

from tandem.engine.request import FinishReason
from tandem.engine.step import StepOutput


class StandInEngine:
    """What the engine loop reads of an engine."""

    def __init__(self):
        self.tokens = int(os.environ.get("TANDEM_FRONT_TOKENS", "1"))
        self.busy_s = float(os.environ.get("TANDEM_FRONT_BUSY_US", "300")) / 1e6
        self.wait_s = float(os.environ.get("TANDEM_FRONT_WAIT_US", "300")) / 1e6
        self.scheduler = SimpleNamespace(running=[], waiting=[], preemptions=0)
        self.allocator = SimpleNamespace(num_free=1024, capacity_pages=1024)
        self.drafts = SimpleNamespace(detached=False, up=lambda: False, settle=lambda: None)
        self.chain = SimpleNamespace(switches=0)
        self.proposer = self.prefix_cache = self.last_step = self.traffic = None
        self.plain_reason, self.requests, self.left = "", {}, {}

    def add_request(self, prompt, params, rid, spec=None, cache_salt=""):
        self.left[rid] = params.max_new_tokens

    def abort(self, rid):
        self.left.pop(rid, None)

    def has_unfinished(self) -> bool:
        return bool(self.left)

    def step(self):
        end = time.perf_counter() + self.busy_s
        while time.perf_counter() < end:
            pass
        time.sleep(self.wait_s)
        outs = []
        for rid, left in list(self.left.items()):
            k = min(self.tokens, left)
            done = left == k
            if done:
                del self.left[rid]
            else:
                self.left[rid] = left - k
            outs.append(StepOutput(rid, [7] * k, FinishReason.LENGTH if done else None))
        return outs

    def shutdown(self, release: bool = True) -> None:
        pass


def build(cfg, metrics):
    """verifier.engine_build.build_engine's stand-in: (engine, no drafter client, no ring)."""
    return StandInEngine(), None, None
