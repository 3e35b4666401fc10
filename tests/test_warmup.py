"""The warm-up runs both kinds of step at every batch size it is given, seeds the policy's costs there,
forgets what its random prompts' rounds taught, and leaves the engine as it found it."""

from __future__ import annotations

import pytest
import torch

from checkpoints import write_checkpoint
from proposers import RandomTreeProposer, Spec
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.warmup import warm_up, warmup_batch_sizes
from tandem.sampling import SamplingParams
from tandem.speculative.policy import cost_bucket


@pytest.mark.parametrize("mixed_prefill", [None, False])  # as on the CPU, and with prompts apart as on a GPU
def test_warm_up_seeds_every_bucket_and_leaves_the_engine_idle(tmp_path, mixed_prefill):
    path = tmp_path / "llama"
    write_checkpoint(path, "llama", seed=3, num_hidden_layers=2)
    prompt = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(path))) as eng:
        reference = eng.generate([prompt], params)[0].output_token_ids
    proposer = RandomTreeProposer(vocab=256, seed=1)
    with LLMEngine(EngineConfig(model=str(path), mixed_prefill=mixed_prefill), proposer=proposer, spec=Spec(4)) as eng:
        free = eng.allocator.num_free
        took = warm_up(eng, [1, 2, 5])
        assert set(took) == {"plain", "speculative", "sampled", "plain (drafter detached)", "arrivals"}
        for n in (1, 2, 5):
            assert eng.policy.step_time(n, False) is not None and eng.policy.step_time(n, True) is not None, n
        assert eng.policy.step_time(16, False) is None  # a bucket it did not run
        assert eng.policy.rounds_all == 0 and eng.policy.tau_all is None  # random prompts' acceptance forgotten
        assert eng.policy.goodput.switch_cost == eng.policy._switch_cost  # the arbiter afresh, its switch cost kept
        assert not eng.requests and not eng.has_unfinished() and eng.allocator.num_free == free
        assert not proposer.tokens  # every warm-up request's draft state released
        assert eng.generate([prompt], params)[0].output_token_ids == reference


def test_warm_up_times_every_chain_the_policy_may_draft(tmp_path):
    """A chain of 3 configured, the measured policy may draft chains of 1 and 2 at batch: the warm-up times rounds of
    each width at each batch size (the depth is weighed on them from the first request), the configured chain's last."""
    from tandem.speculative.spec_config import SpecConfig

    path = tmp_path / "llama"
    write_checkpoint(path, "llama", seed=3, num_hidden_layers=2)
    proposer = RandomTreeProposer(vocab=256, seed=1)
    with LLMEngine(EngineConfig(model=str(path)), proposer=proposer, spec=SpecConfig(3, 1, 4)) as eng:
        took = warm_up(eng, [1, 4])
        assert set(took) == {"plain", "speculative (chain of 1)", "speculative (chain of 2)", "speculative", "sampled",
                             "plain (drafter detached)", "arrivals"}
        for n in (1, 4):
            assert all(eng.policy.step_time(n, True, width=w) is not None for w in (2, 3, 4)), n
        assert eng.policy.spec_width == 4 and eng.chain.current == SpecConfig(3, 1, 4)


def test_the_warm_up_times_plain_steps_without_the_drafter_too(tmp_path):
    """Attached plain steps ship every token's features (a drafter service) or hold them (an in-process head): the
    warm-up also times plain steps with the drafter out of the way (the policy's ``attached_plain_tax``, which widens
    the probe's margin — and lets an in-process head probe at all), with no draft state left behind."""
    path = tmp_path / "llama"
    write_checkpoint(path, "llama", seed=3, num_hidden_layers=2)
    for ships in (True, False):
        proposer = RandomTreeProposer(vocab=256, seed=1)
        proposer.ships_features = ships
        with LLMEngine(EngineConfig(model=str(path)), proposer=proposer, spec=Spec(4)) as eng:
            took = warm_up(eng, [1, 4])
            assert "plain (drafter detached)" in took
            for n in (1, 4):
                assert eng.policy.step_time(n, False, detached=True) is not None, n  # (the tax: of runs, on a GPU)
            assert eng.proposer is proposer and not proposer.tokens and not eng.requests


def test_warm_up_sizes_reach_the_largest_graph_bucket():
    assert warmup_batch_sizes(1) == [1]
    assert warmup_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert warmup_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert {cost_bucket(n) for n in warmup_batch_sizes(256)} == {1, 2, 4, 8, 16, 32, 64, 128, 256}


def test_warm_up_runs_a_lone_prompt_padding_to_each_graphed_prefill_width(tmp_path):
    """The batch sizes' prompts fill a step's prefill budget (longer than any graphed width at batch 1): a first
    short chat turn must not be the first to run the graphed prefill widths' host work."""
    from tandem.prefill_shapes import NARROWEST, prefill_widths

    path = tmp_path / "llama"
    write_checkpoint(path, "llama", seed=3, num_hidden_layers=2)
    with LLMEngine(EngineConfig(model=str(path), prefill_graph_tokens=64)) as eng:
        lone = []
        generate = eng.generate
        eng.generate = lambda prompts, params: (lone.extend(len(p) for p in prompts if len(prompts) == 1),
                                                generate(prompts, params))[1]
        warm_up(eng, [1, 2])
    widths = prefill_widths(64)
    assert widths == (16, 32, 64)
    padded_to = {next(w for w in widths if n <= w) for n in lone if n <= widths[-1]}
    assert padded_to == set(widths) and min(lone) > NARROWEST // 2


def test_the_warm_up_notes_the_runs_of_rounds_it_queued():
    """What lets the warm-up say which chain and batch size never ran a queued run of rounds (their first would be met
    while serving): runs of several rounds are noted by batch size and width, lone rounds and plain runs are not, and
    the step times still reach the real policy."""
    from tandem.engine.warmup import _Forced
    from tandem.speculative.policy import SpeculationPolicy

    policy = SpeculationPolicy()
    forced = _Forced(policy, True, record=True)
    forced.observe_step(64, True, 4, 0.04, resumed=False, width=3)
    forced.observe_step(64, True, 1, 0.01, resumed=False, width=4)
    forced.observe_step(8, False, 4, 0.02, resumed=False, width=None)
    assert forced.queued_runs == {(64, 3)}
    assert policy.step_time(64, True, width=3) == pytest.approx(0.01) and policy.step_time(8, False) == pytest.approx(0.005)
