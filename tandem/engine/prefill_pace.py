"""PrefillPace: how long a prompt's chunk may be while requests decode, from the step costs seen.

A chunk beside decoding requests stalls them for as long as it takes; cut to what prefills in about one run
of their decode steps, a long prompt delays each stream by about one run per chunk instead of a whole
budget's prefill. Only long prompts are cut (as vLLM's ``long_prefill_token_threshold`` singles them out):
a prompt no longer than the cap goes whole, so arrivals still batch.

Both costs are medians of recent samples, so one outlier (a kernel compiled in the step, a catch-up of held
drafter input) does not move them: the prefill cost per token from the last PREFILL_SAMPLES steps of prompts
alone of at least MIN_CHUNK_TOKENS tokens (a short prompt's step is mostly fixed cost; few samples, because a
long prompt's chunks cost more per token as its prefix grows: on an H200 the 8B shape's chunks at 32k keys
cost about twice those at the start), the decode cost per step or round from timed steps of decoding alone,
per mode (a round costs more than a plain step). A stream's gap across a chunk is the chunk's step plus the
one decode step after it (runs resume after that step: StepAccounting.after_prompts; where runs are one graph, a
run of sub-millisecond steps: decode_ahead._owes_one_step), so a chunk aimed at
PACE_SHARE of a run keeps the gap under the two runs' of the goal, with a margin for the chunks that take
longer than aimed (on the H200, up to twice as long at the floor of MIN_CHUNK_TOKENS).

A chunk a prefill graph can take (tandem.engine.prefill_graphs) costs far less than an eager forward of a few
more tokens, whose host launches dominate short chunks: on the H200 the 8B shape's 128-token chunks near 32k
keys replayed in 8-13 ms where eager ones of 158-182 tokens took 19-67 ms. So a cap below GRAPH_SNAP times the
widest graph is cut to that width.
"""

from __future__ import annotations

import statistics
from collections import deque

from tandem.engine.step import StepInfo

MIN_CHUNK_TOKENS = 128  # never cut smaller (fixed costs would dominate); nor learn from smaller steps
SAMPLES = 9  # recent samples of the decode cost
PREFILL_SAMPLES = 3  # recent samples of the prefill cost (it grows along a long prompt)
PACE_SHARE = 0.8  # of a run's time, a chunk's step
GRAPH_SNAP = 2.0  # a cap below this many times the widest prefill graph is cut to that graph's width


class PrefillPace:
    def __init__(self):
        self._prefill_s_per_token: deque[float] = deque(maxlen=PREFILL_SAMPLES)
        self._decode_step_s = {False: deque(maxlen=SAMPLES), True: deque(maxlen=SAMPLES)}

    def observe(self, info: StepInfo, seconds: float) -> None:
        if info.prefill_tokens >= MIN_CHUNK_TOKENS and not info.num_decode:
            self._prefill_s_per_token.append(seconds / info.prefill_tokens)
        elif info.num_decode and not info.num_prefill and info.timed:
            self._decode_step_s[info.speculative].append(seconds / info.steps)

    def chunk_cap(self, run_steps: int, speculating: bool, graph_width: int = 0) -> int | None:
        """Prompt tokens one prompt may add to a step while requests decode in runs of ``run_steps`` steps or
        rounds (``speculating``: rounds): about as many as prefill in PACE_SHARE of such a run, at least
        MIN_CHUNK_TOKENS, and ``graph_width`` (the widest prefill graph; 0: none) where that is within
        GRAPH_SNAP of it; None until both costs are known."""
        decode = self._decode_step_s[speculating] or self._decode_step_s[not speculating]
        if not self._prefill_s_per_token or not decode:
            return None
        per_token, per_step = statistics.median(self._prefill_s_per_token), statistics.median(decode)
        cap = max(MIN_CHUNK_TOKENS, int(PACE_SHARE * run_steps * per_step / per_token))
        return graph_width if graph_width and graph_width <= cap < GRAPH_SNAP * graph_width else cap
