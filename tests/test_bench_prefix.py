"""The prefix-cache benchmark section's helpers (bench/sections_prefix.py), on a tiny CPU model: they run,
measure what they say (a cached second request, cached turns), and the answers match a run without the
cache; the section itself needs a GPU."""

from __future__ import annotations

import pytest
from bench_modules import import_bench

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def sections_prefix():
    (module,) = import_bench("sections_prefix")
    return module


def test_the_section_is_registered():
    (section_index,) = import_bench("section_index")
    assert "prefix" in section_index.SECTIONS


def test_ttft_helper_measures_a_cached_second_request(checkpoint, sections_prefix):
    path = checkpoint("llama", seed=0).path
    with LLMEngine(EngineConfig(model=path, page_size=4)) as eng:
        out = sections_prefix.ttft_second_vs_first(eng, prefix_tokens=40, suffix_tokens=3, repeats=2)
    assert out["cached_tokens"] == [40, 40]
    assert out["first_s"] > 0 and out["second_s"] > 0 and out["ratio"] == out["second_s"] / out["first_s"]


def test_multi_turn_helper_with_and_without_the_cache(checkpoint, sections_prefix):
    path = checkpoint("llama", seed=0).path
    runs = {}
    for cache in (True, False):
        with LLMEngine(EngineConfig(model=path, page_size=4, enable_prefix_caching=cache)) as eng:
            runs[cache] = sections_prefix.multi_turn(eng, system_tokens=20, conversations=3, turns=3,
                                                     message_tokens=5, answer_tokens=4)
    on, off = runs[True], runs[False]
    assert on["outputs"] == off["outputs"]  # float32 on CPU: exactly the same answers
    assert on["prompt_tokens"] == off["prompt_tokens"] and off["cached_tokens"] == 0
    assert on["cached_tokens"] > on["prompt_tokens"] // 2  # later turns start on their history's pages
    assert on["completion_tokens"] == 3 * 3 * 4 and sections_prefix.same_fraction(on["outputs"], off["outputs"]) == 1
