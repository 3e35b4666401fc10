"""The demo pair shipped in the package (tandem/demo_pair): served when nothing was built in the cache, so
the first ``tandem up`` starts at once; the head validates against its target, speculative greedy output
equals target-only greedy output (float32 on the CPU), and the head really accepts on held-out prompts
(its bfloat16 storage did not break it: the recipe's float32 pair reaches an accept length of 3.5 there)."""

from __future__ import annotations

import pytest

from tandem.training import demo


@pytest.fixture()
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    return tmp_path


def test_the_shipped_pair_is_served_until_one_is_built(empty_cache):
    assert demo.ensure_demo_target() == demo.SHIPPED / "target"
    assert demo.ensure_demo_draft() == demo.SHIPPED / "draft"
    built = empty_cache / "demo" / demo.DEMO_VERSION / "target"
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")  # a pair built from the recipes wins from then on
    assert demo.ensure_demo_target() == built


def test_shipped_pair_is_lossless_and_accepts(empty_cache):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.configs.model import ModelConfig
    from tandem.configs.eagle3 import DraftConfig, validate_draft
    from tandem.sampling import SamplingParams
    from tandem.speculative.spec_config import SpecConfig
    from proposers import always_speculate
    from tandem.engine.speculative_setup import speculative_engine
    from tandem.training.demo_pair import demo_eval_prompts

    target, draft = str(demo.ensure_demo_target()), str(demo.ensure_demo_draft())
    assert len(validate_draft(DraftConfig.from_dir(draft), ModelConfig.from_dir(target))) == 3  # raises on a misfit
    prompts = demo_eval_prompts(target)[:6]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    with LLMEngine(EngineConfig(model=target)) as eng:
        reference = [o.output_token_ids for o in eng.generate(prompts, params)]
    with speculative_engine(EngineConfig(model=target), draft, SpecConfig(5, 1, 6),
                            policy=always_speculate()) as eng:
        outs = eng.generate(prompts, params)
    assert [o.output_token_ids for o in outs] == reference
    rounds = sum(o.spec_stats.rounds for o in outs)
    assert sum(len(o.output_token_ids) for o in outs) / rounds >= 2.5
