"""The long-prompt benchmark section's helper (bench/sections_long_prompt.py) on a tiny CPU model: the
streams keep decoding around the long prompt, which gets its token, and both windows' gaps are counted;
the section itself needs a GPU."""

from __future__ import annotations

import time

from bench_modules import import_bench

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine


def test_the_section_is_registered():
    (section_index,) = import_bench("section_index")
    assert "long_prompt" in section_index.SECTIONS


def test_itl_helper_around_a_chunked_long_prompt(checkpoint):
    (module,) = import_bench("sections_long_prompt")
    path = checkpoint("llama", seed=0).path
    with LLMEngine(EngineConfig(model=path, page_size=4, chunked_prefill_size=16)) as eng:
        out = module.itl_around_a_long_prompt(eng, streams=3, stream_prompt=5, long_tokens=100, baseline_s=0.2)
        assert not eng.has_unfinished() and eng.allocator.num_free == eng.allocator.capacity_pages
    # 100 tokens in chunks of at most 16 beside 3 decoding streams: at least 7 steps, each a gap per stream
    assert out["during"]["gaps"] >= 3 * 6 and out["baseline"]["gaps"] > 0
    assert 0 < out["baseline"]["p50_s"] <= out["baseline"]["p99_s"] <= out["baseline"]["max_s"]
    assert out["long_ttft_s"] > 0 and out["p99_ratio"] == out["during"]["p99_s"] / out["baseline"]["p99_s"]


def test_the_gap_across_a_whole_prompt_step_is_counted(checkpoint):
    """Prompts kept apart from the streams and not cut: the streams wait out the prompt's one step, and the
    gap that spans it ends at their next token, after the prompt's first: it must be in the window."""
    (module,) = import_bench("sections_long_prompt")
    path = checkpoint("llama", seed=0).path
    cfg = EngineConfig(model=path, page_size=4, chunked_prefill_size=-1, mixed_prefill=False)
    with LLMEngine(cfg) as eng:
        steps: list[tuple[float, list]] = []
        plain_step = eng.step

        def timed_step():
            started = time.perf_counter()
            outputs = plain_step()
            steps.append((time.perf_counter() - started, outputs))
            return outputs

        eng.step = timed_step
        out = module.itl_around_a_long_prompt(eng, streams=3, stream_prompt=5, long_tokens=200, baseline_s=0.2)
    prompt_step = next(took for took, outputs in steps
                       if any(o.new_token_ids and len(o.new_token_ids) == 1 and o.rid not in _stream_rids(steps)
                              for o in outputs))
    assert out["during"]["max_s"] >= prompt_step


def _stream_rids(steps) -> set:
    """The requests that had tokens in the first step (the streams; the long prompt arrives later)."""
    return {o.rid for o in steps[0][1] if o.new_token_ids}


def test_gap_summary_percentiles():
    (module,) = import_bench("sections_long_prompt")
    s = module._gaps_summary([float(i) for i in range(1, 101)])
    assert s["gaps"] == 100 and s["p99_s"] == 100.0 and s["p50_s"] == 50.5 and s["max_s"] == 100.0
