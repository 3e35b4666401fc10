"""Runs of greedy decode steps in one CUDA graph: members of the target's graph runner (tandem.engine.cuda_graph).

A queued run of ``--decode-steps`` plain steps replays the decode graph once a step, and between two replays the host
samples the step's token (a torch argmax, its copy into the run's buffer) and launches the kernel that advances the
next step's inputs (tandem.kernels.round_glue.advance). Where a step's device time is a fraction of a millisecond that
host work is the step's cost: the demo target spent ~180 µs of Python a step, a third of it there. A run of greedy
steps — no sampling, penalties or logprobs — is one graph instead: each step's argmax (``argmax_rows``, what a greedy
pick computes) into a static ``[steps, bucket]`` buffer, the next step's inputs advanced on the device, and, for an
attached drafter's plain steps, each step's EAGLE-3 features into a static ``[steps, bucket, F]`` one.

Two members, on the families plain steps replay: GREEDY_RUN on the family without features (a speculative engine's
twin, or target-only's decode family), GREEDY_RUN_FEATURES on the decode family with them. Each is captured at the
buckets up to GREEDY_RUN_MAX_BS whose decode graph the capture times at GREEDY_RUN_MAX_STEP_S a step or less (a larger
model's step already hides the host's work behind a queued run: its runs would only cost capture time, ~4 s for
DeepSeek-V2-Lite). One rank only: other ranks follow rank 0's picks a step at a time (tandem.engine.executor).
"""

from __future__ import annotations

import logging

import torch

from tandem.engine.graph_buffers import GraphFamily
from tandem.sampling import argmax_rows

GREEDY_RUN = ("decode", "greedy run")  # a run without features
GREEDY_RUN_FEATURES = ("decode", "greedy run", "features")  # ... and with each step's features (an attached drafter's)
GREEDY_RUN_MAX_BS = 8  # buckets past this are GPU-bound: the per-step replays stay
# ... and so is a bucket whose plain step takes the device longer than this: a queued run already hides the host's
# work of a step there (0.15-0.25 ms on the lent hosts)
GREEDY_RUN_MAX_STEP_S = 0.5e-3

log = logging.getLogger("tandem.cuda_graph")


class GreedyRuns:
    def __init__(self, graphs, plain: GraphFamily | None, featured: GraphFamily | None, steps: int):
        """``graphs``: the TargetGraphRunner these are members of; ``plain`` / ``featured``: the decode families a
        plain step replays without / with features (None: none); ``steps``: the run's length (1: no runs)."""
        self.graphs, self.steps = graphs, steps
        candidates = [b for b in graphs.buckets if b <= GREEDY_RUN_MAX_BS]
        self.families = {member: fam for member, fam in ((GREEDY_RUN, plain), (GREEDY_RUN_FEATURES, featured))
                         if fam is not None and steps > 1 and candidates}
        self._buckets = {member: list(candidates) for member in self.families}
        self._timed: set = set()
        self.tokens = (torch.zeros(steps, candidates[-1], dtype=torch.int64, device=graphs.device)
                       if self.families else None)
        self.features: torch.Tensor | None = None  # [steps, bucket, F]: sized at the first body with features

    def names(self) -> dict:
        return {member: f"decode run of {self.steps} greedy steps" + (" with features" if fam.captures else "")
                for member, fam in self.families.items()}

    def buckets(self, member) -> list[int]:
        """The buckets ``member`` is captured at: on a GPU, asked once its family's decode graphs are captured, those
        whose plain step the device runs within GREEDY_RUN_MAX_STEP_S."""
        if self.graphs.use_graphs and member not in self._timed:
            times = {bs: self._step_seconds(self.families[member], bs) for bs in self._buckets[member]}
            self._buckets[member] = [bs for bs, s in times.items() if s <= GREEDY_RUN_MAX_STEP_S]
            self._timed.add(member)
            log.info("%s in one graph at buckets %s (a step %s ms; up to %.2f ms)", self.names()[member],
                     self._buckets[member] or "none", ", ".join(f"{1e3 * s:.2f}" for s in times.values()),
                     1e3 * GREEDY_RUN_MAX_STEP_S)
        return self._buckets[member]

    def _step_seconds(self, fam: GraphFamily, bs: int, replays: int = 8) -> float:
        """The device's time for one replay of ``fam``'s decode graph at ``bs`` (on padding rows)."""
        self.graphs._pad_all(fam.key, bs)
        graph = self.graphs.graphs[(fam.key, bs)]
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / replays

    def body(self, member, bs: int) -> None:
        """The run's steps on ``member``'s family (padding rows advance within the dummy page)."""
        fam, graphs = self.families[member], self.graphs
        layers = graphs.runner.capture_layers if fam.captures else ()
        for k in range(self.steps):
            if k:
                graphs.advance(fam, bs, self.tokens[k - 1, :bs, None], 1)
            graphs._run_model(fam, bs, layers)
            if fam.captures:
                if self.features is None:  # (a capture's eager warm-up runs first: allocated outside the graph)
                    self.features = torch.empty(self.steps, self.tokens.shape[1], *fam.features.shape[1:],
                                                dtype=fam.features.dtype, device=fam.features.device)
                self.features[k, :bs].copy_(fam.features[:bs])
            self.tokens[k, :bs] = argmax_rows(fam.logits[:bs])

    def run(self, fam: GraphFamily, bs: int, n: int, steps: int, token: torch.Tensor | None, tokens_into: torch.Tensor,
            features_into: list | None) -> bool:
        """Queue the run of ``steps`` greedy steps of the ``n`` sequences ``fam``'s static inputs hold (``prepare``d, or
        going on from ``token``, the last step's tokens of the run before), its tokens into ``tokens_into`` ([steps,
        n]) and, with ``features_into`` (a list), its features appended ([steps, n, F]); → whether a graph took it
        (False: the caller replays a step at a time)."""
        member = next((m for m, f in self.families.items() if f is fam), None)
        if (member is None or steps != self.steps or bs not in self._buckets[member]
                or (features_into is not None and not fam.captures)):
            return False
        graphs = self.graphs
        if token is not None:
            graphs.advance(fam, n, token[:, None], 1)
        with graphs.guard(graphs._replay_name(member, bs)):
            graphs._launch(member, bs)
        tokens_into.copy_(self.tokens[:, :n])
        if features_into is not None:
            features_into.append(self.features[:, :n].clone())
        return True
