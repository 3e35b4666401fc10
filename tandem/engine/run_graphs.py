"""Runs of decode steps in one CUDA graph: members of the target's graph runner (tandem.engine.cuda_graph).

A queued run of ``--decode-steps`` plain steps replays the decode graph once a step, and between two replays the host
samples the step's token (a torch argmax, or the sampler's dozen ops), copies it into the run's buffer and launches
the kernel that advances the next step's inputs (tandem.kernels.round_glue.advance). Where a step's device time is a
fraction of a millisecond that host work is the step's cost: the demo target spent ~180 µs of Python a greedy step, a
third of it there. A run without penalties or logprobs is one graph instead: each step's token — the run's own
StepSampler over static buffers (its settings and uniforms copied in per run), so greedy rows take ``argmax_rows`` and
sampled ones the same inverse-CDF draw as a step at a time — into a static ``[steps, bucket]`` buffer, the next step's
inputs advanced on the device, and for an attached drafter's plain steps each step's EAGLE-3 features into a static
``[steps, bucket, F]`` one.

Members ``run_member(features, sampling)``: on the family a plain step replays without features (a speculative
engine's twin, or target-only's decode family) and on the decode family with them; greedy, sampled, or sampled with a
top-k / top-p cut (the sampler's sort, which a run with no cut skips). Each is captured at the buckets up to
RUN_GRAPH_MAX_BS whose decode graph the capture times at RUN_GRAPH_MAX_STEP_S a step or less (a larger model's step
already hides the host's work behind a queued run: its runs would only cost capture time, ~4 s for DeepSeek-V2-Lite's
greedy runs). One rank only: other ranks follow rank 0's picks a step at a time (tandem.engine.executor).
"""

from __future__ import annotations

import logging

import torch

from tandem.engine.graph_buffers import GraphFamily
from tandem.sampling import RowSampling, StepSampler

SAMPLINGS = ("greedy", "sampled", "sampled with a cut")
# buckets past this replay a step at a time: there a step's host work is shared by more rows, and each bucket's runs
# cost capture time (runs past 8 were never measured)
RUN_GRAPH_MAX_BS = 8
# ... and so is a bucket whose plain step takes the device longer than this: a queued run already hides the host's
# work of a step there (0.15-0.25 ms on the lent hosts)
RUN_GRAPH_MAX_STEP_S = 0.5e-3

log = logging.getLogger("tandem.cuda_graph")


def run_member(features: bool, sampling: str) -> tuple:
    """The graph member of a run with or without features, of ``sampling`` (one of SAMPLINGS)."""
    return ("decode", "run", sampling, "features" if features else "plain")


class RunGraphs:
    def __init__(self, graphs, plain: GraphFamily | None, featured: GraphFamily | None, steps: int,
                 step_s: dict | None = None):
        """``graphs``: the TargetGraphRunner these are members of; ``plain`` / ``featured``: the decode families a
        plain step replays without / with features (None: none); ``steps``: the run's length (1: no runs);
        ``step_s``: decode steps timed already ((family key, bucket) -> seconds)."""
        self.graphs, self.steps = graphs, steps
        candidates = [b for b in graphs.buckets if b <= RUN_GRAPH_MAX_BS]
        self.families = {run_member(fam.captures, sampling): fam for fam in (plain, featured)
                         if fam is not None and steps > 1 and candidates for sampling in SAMPLINGS}
        self._buckets = {member: list(candidates) for member in self.families}
        self.step_s: dict = {} if step_s is None else step_s  # (family key, bucket) -> a plain step's device seconds
        self._timed: set = set()
        if not self.families:
            return
        most, device, vocab = candidates[-1], graphs.device, graphs.runner.model_cfg.vocab_size
        self.tokens = torch.zeros(steps, most, dtype=torch.int64, device=device)
        self.features: torch.Tensor | None = None  # [steps, bucket, F]: sized at the first body with features
        # the sampler's settings and uniforms (padding rows: greedy, no cut)
        full = lambda value, dtype: torch.full((most,), value, dtype=dtype, device=device)  # noqa: E731
        self._rows = (full(True, torch.bool), full(1.0, torch.float32), full(vocab, torch.int64),
                      full(1.0, torch.float32), full(0.0, torch.float32))
        self._uniforms = torch.zeros(steps, most, dtype=torch.float32, device=device)

    def names(self) -> dict:
        return {member: f"decode run of {self.steps} steps, {member[2]}" + (" with features" if fam.captures else "")
                for member, fam in self.families.items()}

    def buckets(self, member) -> list[int]:
        """The buckets ``member`` is captured at: on a GPU, asked once its family's decode graphs are captured, those
        whose plain step the device runs within RUN_GRAPH_MAX_STEP_S."""
        if self.graphs.use_graphs and member not in self._timed:
            fam = self.families[member]
            times = {}
            for bs in sorted(self._buckets[member]):  # (up to the first over the limit: a larger batch is no faster)
                times[bs] = self.step_seconds(fam, bs)
                if times[bs] > RUN_GRAPH_MAX_STEP_S:
                    break
            self._buckets[member] = [bs for bs, s in times.items() if s <= RUN_GRAPH_MAX_STEP_S]
            self._timed.add(member)
            log.info("%s in one graph at buckets %s (a step %s ms; up to %.2f ms)", self.names()[member],
                     self._buckets[member] or "none", ", ".join(f"{1e3 * s:.2f}" for s in times.values()),
                     1e3 * RUN_GRAPH_MAX_STEP_S)
        return self._buckets[member]

    def whole_at(self, n: int) -> bool:
        """Whether runs of ``n`` rows are captured as one graph at their bucket (a plain step there takes the device
        RUN_GRAPH_MAX_STEP_S or less; a run a member cannot take, its logprobs or penalties, still replays a step at a
        time at that pace)."""
        bs = self.graphs.bucket(n)
        return bs is not None and any(bs in self.buckets(member) for member in self.families)

    def step_seconds(self, fam: GraphFamily, bs: int, replays: int = 8) -> float:
        """The device's time for one replay of ``fam``'s decode graph at ``bs`` (on padding rows), timed once."""
        if (fam.key, bs) not in self.step_s:
            self.graphs._pad_all(fam.key, bs)
            graph = self.graphs.graphs[(fam.key, bs)]
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with self.graphs.guard(f"time the decode graph bs={bs}", self.graphs.capture_deadline_s):
                start.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                end.synchronize()
            self.step_s[(fam.key, bs)] = start.elapsed_time(end) / 1e3 / replays
        return self.step_s[(fam.key, bs)]

    def _sampler(self, sampling: str, bs: int) -> StepSampler:
        """The run's sampler over the static buffers' first ``bs`` rows (a greedy run's: argmax alone). Every rule a
        sampled member might need is on (min-p, greedy rows): with its neutral values it changes no token."""
        if sampling == "greedy":
            return StepSampler.over(None, None)
        greedy, temps, top_k, top_p, min_p = (t[:bs] for t in self._rows)
        rows = RowSampling(greedy, temps, top_k, top_p, min_p, any_greedy=True,
                           any_cut=sampling == "sampled with a cut", any_min_p=True)
        return StepSampler.over(rows, self._uniforms[:, :bs])

    def body(self, member, bs: int) -> None:
        """The run's steps on ``member``'s family (padding rows advance within the dummy page)."""
        fam, graphs = self.families[member], self.graphs
        layers = graphs.runner.capture_layers if fam.captures else ()
        sampler = self._sampler(member[2], bs)
        for k in range(self.steps):
            if k:
                graphs.advance(fam, bs, self.tokens[k - 1, :bs, None], 1)
            graphs._run_model(fam, bs, layers)
            if fam.captures:
                if self.features is None:  # (a capture's eager warm-up runs first: allocated outside the graph)
                    self.features = torch.empty(self.steps, self.tokens.shape[1], *fam.features.shape[1:],
                                                dtype=fam.features.dtype, device=fam.features.device)
                self.features[k, :bs].copy_(fam.features[:bs])
            self.tokens[k, :bs] = sampler(fam.logits[:bs], k)

    def run(self, fam: GraphFamily, bs: int, n: int, steps: int, token: torch.Tensor | None, tokens_into: torch.Tensor,
            features_into: list | None, sampler: StepSampler) -> bool:
        """Queue the run of ``steps`` steps of the ``n`` sequences ``fam``'s static inputs hold (``prepare``d, or going
        on from ``token``, the last step's tokens of the run before), sampled as ``sampler`` samples, its tokens into
        ``tokens_into`` ([steps, n]) and, with ``features_into`` (a list), its features appended ([steps, n, F]); →
        whether a graph took it (False: the caller replays a step at a time)."""
        rows = sampler.rows
        sampling = "greedy" if rows is None else SAMPLINGS[2] if rows.any_cut else SAMPLINGS[1]
        member = run_member(fam.captures, sampling)
        if (self.families.get(member) is not fam or steps != self.steps or bs not in self._buckets[member]
                or (features_into is not None and not fam.captures)):
            return False
        if rows is not None:
            for static, given in zip(self._rows, (rows.greedy, rows.temps, rows.top_k, rows.top_p, rows.min_p)):
                static[:n].copy_(given)
            self._uniforms[:, :n].copy_(sampler.uniforms)
        graphs = self.graphs
        if token is not None:
            graphs.advance(fam, n, token[:, None], 1)
        with graphs.guard(graphs._replay_name(member, bs)):
            graphs._launch(member, bs)
        tokens_into.copy_(self.tokens[:, :n])
        if features_into is not None:
            features_into.append(self.features[:, :n].clone())
        return True
