"""On the GPU: runs of decode steps captured as one graph each (tandem.engine.run_graphs) give the tokens of one step at
a time — greedy, sampled, with top-k / top-p cuts and min-p, at several batch sizes — in float32, where the two paths
replay the same kernels; and an attached drafter's plain runs (features kept) leave speculative output target-only's.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tandem.models.random_checkpoint import LlamaShape, write_random_llama

    shape = LlamaShape(vocab_size=4096, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4,
                       num_kv_heads=2, max_position_embeddings=1024)
    return write_random_llama(tmp_path_factory.mktemp("runs") / "t", shape, dtype="float32", seed=3, std=0.05)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, 4096, (int(length),), generator=g).tolist() for length in torch.randint(3, 60, (n,), generator=g)]


def _config(target, decode_steps: int):
    from tandem.engine.config import EngineConfig

    return EngineConfig(model=str(target), device="cuda", dtype="float32", cuda_graph_max_bs=8, page_size=16,
                        kv_pages=1024, decode_steps=decode_steps)


def _replays(engine) -> list:
    """The run members replayed from now on (the graph runner's launches, recorded)."""
    graphs, seen = engine.executor.runner.graphs, []
    launch = graphs._launch
    graphs._launch = lambda member, bs: (seen.append(member) if member in graphs.run_graphs.families else None,
                                         launch(member, bs))
    return seen


def test_runs_in_one_graph_equal_one_step_decoding(target):
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.run_graphs import run_member
    from tandem.sampling import SamplingParams

    cases = [("greedy", SamplingParams(max_new_tokens=33, ignore_eos=True)),
             ("sampled", SamplingParams(temperature=0.9, seed=1, min_p=0.05, max_new_tokens=33, ignore_eos=True)),
             ("sampled with a cut", SamplingParams(temperature=1.1, top_p=0.9, top_k=200, seed=2, max_new_tokens=33,
                                                   ignore_eos=True))]
    with LLMEngine(_config(target, 1)) as one:
        references = {(n, name): [r.output_token_ids for r in one.generate(_prompts(n), params)]
                      for n in (1, 3, 8) for name, params in cases}
    with LLMEngine(_config(target, 4)) as runs:
        member = run_member(False, "greedy")
        assert runs.executor.runner.graphs.run_graphs.buckets(member) == list(range(1, 9)), "this target's steps are host-bound"
        replays = _replays(runs)
        for (n, name), reference in references.items():
            params = dict(cases)[name]
            replays.clear()
            assert [r.output_token_ids for r in runs.generate(_prompts(n), params)] == reference, (n, name)
            assert replays.count(run_member(False, name)) >= 7, (n, name, replays)  # 32 tokens after the prefill's


def test_an_attached_drafters_plain_runs_keep_speculation_lossless(target, tmp_path):
    """A speculative engine whose policy goes plain after its first rounds (a fixed cost ratio no τ reaches) decodes
    in runs with features (the drafter attached, kept in step); explorations speculate again from those features.
    Greedy output equals target-only's."""
    from tandem.configs.model import ModelConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.run_graphs import run_member
    from tandem.engine.speculative_setup import speculative_engine
    from tandem.models.eagle3_checkpoint import write_random_eagle3
    from tandem.sampling import SamplingParams
    from tandem.speculative.policy import PolicyConfig, SpeculationPolicy
    from tandem.speculative.spec_config import SpecConfig

    prompts, params = _prompts(3), SamplingParams(max_new_tokens=60, ignore_eos=True)
    with LLMEngine(_config(target, 1)) as plain:
        reference = [r.output_token_ids for r in plain.generate(prompts, params)]
    write_random_eagle3(tmp_path / "draft", ModelConfig.from_dir(target), draft_vocab_size=1024, seed=1)
    policy = SpeculationPolicy(PolicyConfig(fixed_cost_ratio=6.0, explore_every=2, explore_max_gap=8))
    with speculative_engine(_config(target, 4), str(tmp_path / "draft"), SpecConfig(3, 1, 4), policy=policy) as eng:
        replays = _replays(eng)
        outputs = eng.generate(prompts, params)
    assert [r.output_token_ids for r in outputs] == reference
    assert run_member(True, "greedy") in replays, replays
    assert sum(r.spec_stats.rounds for r in outputs) > 0
