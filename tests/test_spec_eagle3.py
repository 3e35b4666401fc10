"""Greedy speculative decoding with the real EAGLE-3 drafter (random head) is token-identical to
target-only greedy decoding, over many tree settings, batches of different prompt lengths and
sequences that cross page boundaries (property-based)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling import SamplingParams
from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
from tandem.speculative.spec_config import SpecConfig
from proposers import always_speculate


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from draft_checkpoints import write_pair
    from helpers import target_only_greedy, torch_prompts

    root = tmp_path_factory.mktemp("eagle3pair")
    write_pair(root, target_seed=13, draft_seed=5)
    prompts = torch_prompts(2, (2, 7, 15, 30))
    return root, prompts, target_only_greedy(root / "target", prompts, 24)


@st.composite
def spec_configs(draw):
    steps = draw(st.integers(1, 6))
    topk = draw(st.integers(1, 4))
    most = min(16, steps + 1 if topk == 1 else 1 + topk + (steps - 1) * topk * topk)
    return SpecConfig(steps, topk, draw(st.integers(2, most)))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=spec_configs(), page_size=st.sampled_from([1, 4, 16]), batch=st.integers(1, 4))
def test_greedy_with_the_eagle3_drafter_is_token_identical(pair, spec, page_size, batch):
    root, prompts, ref = pair
    from tandem.configs.model import ModelConfig
    from tandem.configs.eagle3 import DraftConfig, validate_draft

    capture = validate_draft(DraftConfig.from_dir(root / "draft"), ModelConfig.from_dir(root / "target"))
    cfg = EngineConfig(model=str(root / "target"), page_size=page_size, capture_layers=capture)
    with LLMEngine(cfg, spec=spec, policy=always_speculate()) as eng:
        runner = eng.executor.runner
        eng.proposer = Eagle3Drafter.from_dirs(str(root / "draft"), str(root / "target"),
                                               DrafterConfig(page_size=page_size), capture_layers=capture,
                                               embed_weight=runner.model.model.embed_tokens.weight)
        eng.default_spec = spec
        results = eng.generate(prompts[:batch], SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [r.output_token_ids for r in results] == ref[:batch]
    assert all(r.spec_stats.rounds > 0 for r in results)


def test_greedy_with_chain_tokens_left_on_the_device_is_token_identical(pair):
    """The in-process fast path: the graphed chain draft returns without its tokens (they stay on the
    device for the verify, and reach the host with its results) — same output as target-only, with two
    chain settings drafted in one step and requests arriving while others verify pending chains."""
    from tandem.configs.model import ModelConfig
    from tandem.configs.eagle3 import DraftConfig, validate_draft
    from tandem.speculative.draft_graph import DraftGraphRunner

    root, prompts, ref = pair
    specs = [SpecConfig(3, 1, 4), SpecConfig(5, 1, 4)]
    capture = validate_draft(DraftConfig.from_dir(root / "draft"), ModelConfig.from_dir(root / "target"))
    cfg = EngineConfig(model=str(root / "target"), page_size=4, capture_layers=capture)
    with LLMEngine(cfg, spec=specs[0], policy=always_speculate()) as eng:
        drafter = Eagle3Drafter.from_dirs(str(root / "draft"), str(root / "target"),
                                          DrafterConfig(page_size=4, defer_chain_tokens=True), capture_layers=capture,
                                          embed_weight=eng.executor.runner.model.model.embed_tokens.weight)
        drafter.graphs = DraftGraphRunner(drafter, specs, buckets=[1, 2, 4], use_graphs=False, attention="torch")
        pending, groups_per_step = [], []
        real_draft = drafter.draft

        def spying_draft(rids, s):
            trees = real_draft(rids, s)
            pending.extend(t.pending is not None and -1 in t.tokens for t in trees)
            groups_per_step[-1] += 1
            return trees

        drafter.draft = spying_draft
        eng.proposer, eng.default_spec = drafter, specs[0]
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        rids = [eng.add_request(prompts[0], params), eng.add_request(prompts[1], params, spec=specs[1])]
        mixed = 0
        for step in range(200):
            if step in (3, 7):  # arrives while the others verify chains whose tokens are still on the device
                i = 2 if step == 3 else 3
                rids.append(eng.add_request(prompts[i], params, spec=specs[i % 2]))
            groups_per_step.append(0)
            eng.step()
            mixed += bool(eng.last_step.num_prefill and eng.last_step.num_decode and groups_per_step[-1])
            if not eng.has_unfinished():
                break
        results = [eng.requests.pop(r) for r in rids]
    assert [r.output for r in results] == ref
    assert pending and all(pending)  # every draft went through the deferred path
    assert sum(r.spec_stats.rounds for r in results) == len(pending)
    assert max(groups_per_step) == 2  # both chain settings drafted (and verified) in one step
    assert mixed >= 1  # a prefill joined a step with pending chains (the eager path reads them back)
