"""The prefill pace (tandem.engine.prefill_pace) on explicit step times: a long prompt's chunk beside
decoding requests is cut to what prefills in one run of their steps, from medians that one outlier does not
move, per mode, and never below its floor."""

from __future__ import annotations

from tandem.engine.prefill_pace import GRAPH_SNAP, MIN_CHUNK_TOKENS, PACE_SHARE, PrefillPace
from tandem.engine.step import StepInfo


def prompts(tokens: int) -> StepInfo:
    return StepInfo(num_prefill=1, num_decode=0, spans={}, prefill_tokens=tokens)


def decode(steps: int = 4, speculative: bool = False, timed: bool = True) -> StepInfo:
    return StepInfo(num_prefill=0, num_decode=16, spans={}, steps=steps, speculative=speculative, timed=timed)


def test_the_cap_is_what_prefills_in_a_run_of_decode_steps():
    pace = PrefillPace()
    assert pace.chunk_cap(4, False) is None  # nothing seen: the budget alone
    pace.observe(prompts(8192), 0.4096)  # 50 us per prompt token
    assert pace.chunk_cap(4, False) is None  # no decode step seen yet
    pace.observe(decode(steps=4), 0.02)  # 5 ms per step
    assert pace.chunk_cap(4, False) == int(PACE_SHARE * 400)  # a run of 4 steps (20 ms) prefills 400 tokens
    assert pace.chunk_cap(1, False) == MIN_CHUNK_TOKENS  # 100 would be all fixed cost
    pace.observe(decode(steps=2, speculative=True), 0.016)  # rounds: 8 ms each
    assert pace.chunk_cap(4, True) == int(PACE_SHARE * 640)  # each mode its own pace
    assert pace.chunk_cap(4, False) == int(PACE_SHARE * 400)


def test_outliers_short_prompts_mixed_and_catch_up_steps_do_not_move_it():
    pace = PrefillPace()
    for _ in range(3):
        pace.observe(prompts(4096), 0.2048)
        pace.observe(decode(), 0.02)
    pace.observe(prompts(4096), 30.0)  # a kernel compiled in the step: one sample of a median
    pace.observe(prompts(20), 0.01)  # a short prompt: mostly fixed cost, not learned from
    pace.observe(StepInfo(num_prefill=1, num_decode=16, spans={}, prefill_tokens=512), 1.0)  # mixed: neither
    pace.observe(decode(timed=False), 5.0)  # a step that caught the drafter up
    assert pace.chunk_cap(4, False) == int(PACE_SHARE * 400)


def test_the_prefill_cost_follows_a_long_prompt_whose_chunks_grow_dearer():
    """A long prompt's chunks cost more per token as its prefix grows: the cap follows within a few chunks."""
    pace = PrefillPace()
    pace.observe(decode(), 0.02)
    for _ in range(9):
        pace.observe(prompts(2048), 2048 * 25e-6)  # the streams' own prompts: cheap per token
    for _ in range(3):
        pace.observe(prompts(400), 400 * 100e-6)  # late chunks: four times dearer
    assert pace.chunk_cap(4, False) == int(PACE_SHARE * 200)


def test_a_cap_within_reach_of_the_widest_prefill_graph_is_cut_to_its_width():
    """A replayed graph's chunk costs far less than an eager one of a few more tokens."""
    pace = PrefillPace()
    pace.observe(prompts(8192), 0.4096)  # 50 us per prompt token
    pace.observe(decode(steps=4), 0.02)  # a run of 4 steps prefills 400 tokens: cap 320
    assert pace.chunk_cap(4, False) == 320
    assert pace.chunk_cap(4, False, graph_width=256) == 256  # within GRAPH_SNAP of the 256-wide graph
    assert pace.chunk_cap(4, False, graph_width=128) == 320  # 320 >= 2 x 128: eager, as paced
    assert pace.chunk_cap(4, False, graph_width=512) == 320  # the graph is wider than the cap: the cap
    assert GRAPH_SNAP * 128 <= 320
