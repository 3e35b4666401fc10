"""Problems found reviewing 8011736..HEAD (each test fails on that HEAD)."""

from __future__ import annotations

import pytest

from draft_checkpoints import pair_engine
from helpers import random_prompt
from tandem.sampling import SamplingParams
from tandem.speculative.attachment import AttachmentConfig, DrafterAttachment
from tandem.speculative.drafter import SpecConfig


def test_a_decode_run_wider_than_the_decode_graphs_but_within_a_prefill_bucket_runs(tmp_path, monkeypatch):
    """--cuda-graph-max-bs 2 with --prefill-graph-max-bs 4: a run of decode steps of 3 requests. can_run now
    says yes (the 16-wide prefill family takes three 1-token chunks), so queue_decode_steps queues a graphed
    run, whose prepare() looks for a decode bucket of 3 (none): the step fails instead of running eagerly."""
    from helpers import TorchGraphBackend, torch_prompts
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.models.random_checkpoint import LlamaShape, write_random_llama

    path = write_random_llama(tmp_path / "t", LlamaShape(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        max_position_embeddings=256), seed=8, std=0.08)
    monkeypatch.setattr("tandem.attention.graph_backend.make_graph_backend", lambda latent=False: TorchGraphBackend())
    prompts = torch_prompts(9, (5, 12, 3))
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    outputs = {}
    for graphs in (True, False):
        cfg = EngineConfig(model=str(path), page_size=4, static_graph_path=graphs, cuda_graph_max_bs=2,
                           decode_steps=4, prefill_graph_tokens=16, prefill_graph_max_bs=4)
        with LLMEngine(cfg) as eng:
            outputs[graphs] = [r.output_token_ids for r in eng.generate(prompts, params)]
    assert outputs[True] == outputs[False]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_prompt_arriving_at_an_idle_engine_after_the_detached_period_speculates(pair):
    """Detached, then the batch drains and the detached period ends while the engine is idle. _decide returns
    before _keep_attachment when nothing runs, so the next prompt is prefilled while the engine still counts
    itself detached (attach() says no) and decodes plainly to its end, though the period ended long ago."""
    greedy = SamplingParams(max_new_tokens=14, ignore_eos=True)
    prompts = [random_prompt(700 + i, 9 + 3 * i) for i in range(4)]
    clock = Clock()
    with pair_engine(pair, SpecConfig(3, 1, 4), page_size=4) as eng:
        eng.attachment = DrafterAttachment(AttachmentConfig(detach_after_s=0.0, detach_after_steps=2,
                                                            detached_first_s=5.0), clock)
        speculate = [False]
        eng.policy.decide = lambda batch, drafting, runs=None: bool(drafting) and speculate[0]
        for p in prompts[:3]:
            eng.add_request(p, greedy)
        while not eng.attachment.detached:
            eng.step()
        while eng.has_unfinished():
            eng.step()
        speculate[0] = True
        clock.now += 60.0  # idle for a minute: the 5 s detached period is long over
        late = eng.add_request(prompts[3], greedy)
        while eng.has_unfinished():
            eng.step()
        assert eng.requests[late].spec_stats.rounds > 0
