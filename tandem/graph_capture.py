"""CUDA graphs: what the target's runner (tandem.engine.cuda_graph) and the drafter's
(tandem.speculative.draft_graph) share.

A runner keeps one graph per (member, bucket): a member is what one graph computes (a verify width, a
draft SpecConfig, the draft-extend) and a bucket the batch size a batch pads to. Capture runs largest
bucket first into one memory pool (later graphs reuse its memory), each under a watchdog deadline,
with one log line per family of members. Replays are guarded too. Without graphs (``use_graphs=False``:
the CPU tests) a replay runs the captured body eagerly on the same static buffers, so everything but
capture itself is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch

from tandem.matmul_warm import MatmulWarm
from tandem.watchdog import Watchdog


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream every graph of a device is captured on. cuBLAS keeps a workspace per stream
    it runs on, inside the graph pool: a fresh stream per capture would hold one per graph."""
    return torch.cuda.Stream(device)


def batch_buckets(max_bs: int) -> list[int]:
    """1..8 densely, then every 8 up to 64, then every 16: what a padded batch rounds up to."""
    sizes = [b for b in (1, 2, 3, 4, 5, 6, 7, 8) if b <= max_bs]
    sizes += list(range(16, min(max_bs, 64) + 1, 8)) + list(range(80, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sorted(set(sizes))


class GraphRunner:
    """The graphs of one model. A subclass says what to capture (``capture_plan``), what a graph runs
    (``_body``) and how a batch of padding rows is staged for its capture (``_pad_all``)."""

    # eager runs before each capture: two at a member's first (largest) bucket, where its kernels first run on the
    # capture stream; one at the others (a smaller batch may still hit a kernel specialisation not yet compiled). Two
    # everywhere were 5.0 of DeepSeek-V2-Lite's 8.0 s of capture (bench/capture_phases.py)
    FIRST_WARMUPS, LATER_WARMUPS = 2, 1

    def __init__(self, device: torch.device, buckets: list[int], *, use_graphs: bool, log_name: str,
                 watchdog: Watchdog | None = None, pool=None, capture_deadline_s: float = 120.0,
                 replay_deadline_s: float = 60.0):
        self.device = device
        self.buckets = sorted(set(buckets))
        self.max_bs = self.buckets[-1]
        self.use_graphs = use_graphs
        # Captures and replays are guarded; the static path without graphs (CPU tests) needs no thread.
        self.watchdog = watchdog or (Watchdog() if use_graphs else None)
        self.pool = pool  # the caller's (the drafter shares the target's) or one made at the first capture
        self.capture_deadline_s, self.replay_deadline_s = capture_deadline_s, replay_deadline_s
        self.graphs: dict[tuple[object, int], torch.cuda.CUDAGraph] = {}  # (member, bucket) -> graph
        self.log = logging.getLogger(log_name)

    # -- what a subclass defines ---------------------------------------------------------------------
    def capture_plan(self) -> list[tuple[str, list]]:
        """[(family name, its members)], in capture order."""
        raise NotImplementedError

    def _body(self, member, bs: int) -> None:
        """The work one graph runs, on the static buffers."""
        raise NotImplementedError

    def _pad_all(self, member, bs: int) -> None:
        """Stage ``bs`` padding rows (their KV goes to the dummy page only), for a capture."""
        raise NotImplementedError

    def member_buckets(self, member) -> list[int]:
        """The batch sizes ``member`` is captured at: the runner's buckets unless a member has its own."""
        return self.buckets

    # -- buckets, guards, replays --------------------------------------------------------------------
    def bucket(self, n: int) -> int | None:
        """The captured batch size ``n`` requests pad to (None: more than the largest)."""
        return next((b for b in self.buckets if b >= n), None)

    def guard(self, what: str, deadline_s: float | None = None):
        """A watchdog guard (a replay's deadline unless told), for a replay or for waiting on queued ones."""
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.guard(what, self.replay_deadline_s if deadline_s is None else deadline_s)

    def _launch(self, member, bs: int) -> None:
        """Queue graph (member, bs); without graphs, run its body."""
        if self.use_graphs:
            self.graphs[(member, bs)].replay()
        else:
            self._body(member, bs)

    # -- capture -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, warm: MatmulWarm | None = None) -> dict[str, tuple[float, float]]:
        """Capture every member of every family at every bucket; → {family: (seconds, GB)}. ``warm``: the start's
        warm-up of cuBLAS, which records the capture's products where it had none to replay."""
        with warm.recording() if warm is not None else contextlib.nullcontext():
            report = self._capture_families()
        if warm is not None:
            warm.save()
        return report

    def _capture_families(self) -> dict[str, tuple[float, float]]:
        report = {}
        for name, members in self.capture_plan():
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
            started = time.perf_counter()
            for member in members:
                # largest first: smaller graphs reuse its pool memory
                for i, bs in enumerate(reversed(self.member_buckets(member))):
                    with self.guard(f"Capture {name} cuda graph bs={bs}", self.capture_deadline_s):
                        warmups = self.FIRST_WARMUPS if i == 0 else self.LATER_WARMUPS
                        self.graphs[(member, bs)] = self._capture_one(member, bs, warmups)
            torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - started
            free_after = torch.cuda.mem_get_info(self.device)[0]
            used_gb = (free_before - free_after) / 1e9
            self.log.info("Capture %s cuda graph end. Time elapsed: %.2f s. mem usage=%.2f GB. avail mem=%.2f GB.",
                          name, elapsed, used_gb, free_after / 1e9)
            report[name] = (elapsed, used_gb)
        return report

    @torch.inference_mode()
    def run_statically(self) -> None:
        """Without graphs: each member once at the largest bucket on padding rows, as a capture's warm-up
        (sizing the static outputs); replays then run the bodies."""
        for _, members in self.capture_plan():
            for member in members:
                bs = self.static_warmup_bucket(member)
                self._pad_all(member, bs)
                self._body(member, bs)

    def static_warmup_bucket(self, member) -> int:
        """The bucket ``run_statically`` runs ``member`` at: the largest, as a capture's warm-up."""
        return self.member_buckets(member)[-1]

    def _capture_one(self, member, bs: int, warmups: int) -> torch.cuda.CUDAGraph:
        self._pad_all(member, bs)
        stream = capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmups):  # Triton's compiles, cuBLAS's handles and allocator growth stay outside the graph
                self._body(member, bs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self._body(member, bs)
        graph.replay()  # the first launch uploads the graph (slow): do it here, on padding inputs, not mid-serving
        return graph
