"""Chunked prefill (--chunked-prefill-size) and --context-length: greedy output identical with and without
chunking at chunk sizes that cut prompts at page boundaries and inside pages, target-only and with the
EAGLE-3 drafter (chains and trees, speculation switched on and off between chunks), the drafter fed
exactly what a whole-prompt prefill gives it, seeded sampling unchanged, decoding requests getting a
token every step while a long prompt prefills, and a prompt mid-prefill preempted and recomputed."""

from __future__ import annotations

import pytest
import torch

from draft_checkpoints import pair_engine
from helpers import random_prompt
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.errors import ConfigError, OutOfPagesError
from tandem.sampling import SamplingParams
from tandem.speculative.spec_config import SpecConfig
from tandem.speculative.policy import SpeculationPolicy

PAGE = 4
PROMPTS = [random_prompt(300 + i, n) for i, n in enumerate((3, 17, 40, 64))]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
CHUNKS = (4, 7, 16, 33)  # 4 and 16 cut at page boundaries, 7 and 33 inside pages


class Scripted(SpeculationPolicy):
    """A policy that speculates on alternate steps (chunks go to the drafter both held and at once)."""

    def __init__(self):
        super().__init__()
        self.steps = 0

    def decide(self, batch_size, drafting, runs=None) -> bool:
        self.steps += 1
        return self.steps % 2 == 0 and bool(drafting)


def engine(pair, chunk: int, spec: SpecConfig | None = None, policy=None, **kw) -> LLMEngine:
    return pair_engine(pair, spec, policy, page_size=PAGE, chunked_prefill_size=chunk, **kw)


def staggered(eng: LLMEngine, params) -> list[list[int]]:
    """The first two prompts decode a few steps, then the long ones arrive; outputs in prompt order."""
    rids = [eng.add_request(p, params) for p in PROMPTS[:2]]
    for _ in range(3):
        eng.step()
    rids += [eng.add_request(p, params) for p in PROMPTS[2:]]
    while eng.has_unfinished():
        eng.step()
    assert eng.allocator.num_free == eng.allocator.capacity_pages
    return [eng.requests.pop(r).output for r in rids]


@pytest.fixture(scope="module")
def reference(pair):
    with engine(pair, -1) as eng:
        return staggered(eng, GREEDY)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_target_only_greedy_is_unchanged_by_chunking(pair, reference, chunk):
    with engine(pair, chunk) as eng:
        assert staggered(eng, GREEDY) == reference


def _recording(drafter):
    """Wrap the drafter's extend: → {rid: [(tokens, features)]} in the order it got them."""
    got: dict[str, list] = {}
    real = drafter.extend

    def extend(items):
        for rid, tokens, feats in items:
            got.setdefault(rid, []).append((list(tokens), feats.detach().clone()))
        return real(items)

    drafter.extend = extend
    return got


@pytest.mark.parametrize("spec,chunk,scripted", [(SpecConfig(3, 1, 4), 7, False), (SpecConfig(3, 1, 4), 16, True),
                                                  (SpecConfig(3, 2, 6), 4, True), (SpecConfig(2, 3, 7), 33, False)])
def test_speculative_greedy_is_unchanged_and_the_drafter_gets_the_whole_prompt(pair, reference, spec, chunk, scripted):
    runs = {}
    for size in (-1, chunk):
        with engine(pair, size, spec, policy=Scripted() if scripted else None) as eng:
            got = _recording(eng.proposer)
            runs[size] = (staggered(eng, GREEDY), got)
    assert runs[chunk][0] == reference and runs[-1][0] == reference
    whole, chunked = runs[-1][1], runs[chunk][1]
    for i, prompt in enumerate(PROMPTS):  # the prompt's part of the drafter's input: (token_{t+1}, feature_t)
        rid, n = f"req-{i}", len(prompt)
        tokens = [t for toks, _ in chunked[rid] for t in toks][:n]
        assert tokens == [t for toks, _ in whole[rid] for t in toks][:n] == prompt[1:] + [reference[i][0]]
        feats = torch.cat([f for _, f in chunked[rid]])[:n]
        torch.testing.assert_close(feats, torch.cat([f for _, f in whole[rid]])[:n], rtol=1e-4, atol=1e-5)


def test_seeded_sampling_is_unchanged_by_chunking(pair):
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=11 + i, max_new_tokens=10, ignore_eos=True)
              for i in range(len(PROMPTS))]
    outs = []
    for chunk, spec in ((-1, None), (7, None), (-1, SpecConfig(3, 2, 6)), (7, SpecConfig(3, 2, 6))):
        with engine(pair, chunk, spec) as eng:
            outs.append([r.output_token_ids for r in eng.generate(PROMPTS, params)])
    assert outs[0] == outs[1]
    assert outs[2] == outs[3]


def test_decoding_requests_get_a_token_every_step_while_a_long_prompt_prefills(pair):
    budget, long_prompt = 8, random_prompt(320, 61)
    with engine(pair, budget) as eng:
        forwards = []
        real = eng.executor.forward
        eng.executor.forward = lambda batch, **kw: forwards.append(batch.num_tokens) or real(batch, **kw)
        streams = [eng.add_request(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in PROMPTS[:2]]
        while not all(eng.requests[rid].output for rid in streams):  # their own prompts take 3 steps
            eng.step()
        late = eng.add_request(long_prompt, GREEDY)
        per_step = []
        while not eng.requests[late].output:
            outputs = {o.rid: len(o.new_token_ids) for o in eng.step()}
            per_step.append(outputs)
        assert len(per_step) == -(-len(long_prompt) // budget)  # 8 chunks, the first token with the last
        assert all(step[rid] == 1 for step in per_step for rid in streams)
        assert all(n <= budget + len(streams) for n in forwards)  # a step's work stays within the budget
        while eng.has_unfinished():
            eng.step()
        long_out = eng.requests[late].output
    with engine(pair, -1) as eng:
        assert eng.generate([long_prompt], GREEDY)[0].output_token_ids == long_out


def test_beside_decoding_requests_a_prompt_is_cut_to_the_learned_cap_and_alone_to_the_budget(pair):
    """The cap (PrefillPace.chunk_cap, learned from step times; fixed here) cuts a prompt's chunks while
    requests decode; a prompt no longer than the cap goes whole; with nothing decoding, the budget alone."""
    budget, cap, long_prompt = 64, 12, random_prompt(321, 61)
    with engine(pair, budget, enable_prefix_caching=False) as eng:  # (the same prompt twice: computed twice)
        eng.accounting.pace.chunk_cap = lambda run_steps, speculating, graph_width=0: cap
        alone = eng.add_request(long_prompt, GREEDY)
        eng.step()
        assert eng.requests[alone].output  # nothing decoding: the 61 tokens in one step of the 64 budget
        streams = [eng.add_request(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in PROMPTS[:2]]
        while not all(eng.requests[rid].output for rid in streams):
            eng.step()
        short, late = eng.add_request(PROMPTS[0], GREEDY), eng.add_request(long_prompt, GREEDY)
        steps_to_first = {short: 0, late: 0}
        while not eng.requests[late].output:
            eng.step()
            for rid in steps_to_first:
                steps_to_first[rid] += not eng.requests[rid].output
        assert steps_to_first[short] == 0  # 3 tokens: whole, in the first step
        assert steps_to_first[late] + 1 == -(-len(long_prompt) // cap)  # chunks of 12
        while eng.has_unfinished():
            eng.step()
        assert eng.requests[late].output == eng.requests[alone].output  # greedy: as prefilled whole


def test_a_chunk_kept_apart_from_decoding_requests_is_waited_for_so_that_the_pace_learns_its_cost(pair):
    """A chunk emits no token, so nothing reads its device work back: without a wait, the prefill pace would
    learn only its launch's time (on an H200 the 8B shape's chunks near 32k keys ran ~3x longer than timed)."""
    budget, cap, long_prompt = 64, 12, random_prompt(322, 61)
    with engine(pair, budget, mixed_prefill=False) as eng:
        eng.accounting.pace.chunk_cap = lambda run_steps, speculating, graph_width=0: cap
        waits = []
        eng.executor.synchronize = lambda: waits.append(eng.last_step)
        streams = [eng.add_request(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in PROMPTS[:2]]
        while not all(eng.requests[rid].output for rid in streams):
            eng.step()
        assert not waits  # prompts with nothing decoding beside them: their tokens are read back anyway
        late = eng.add_request(long_prompt, GREEDY)
        while not eng.requests[late].output:
            eng.step()
        chunks = -(-len(long_prompt) // cap)
        assert len(waits) == chunks - 1  # every chunk but the last, which samples the first token
        assert all(info.num_prefill and not info.num_decode for info in waits)


def test_a_prompt_mid_prefill_is_preempted_and_recomputed(pair, reference):
    """A KV cache so small that the decoding requests need the pages of the prompt in prefill: it gives
    them back (the most recently admitted) and is prefilled again later; outputs are unchanged."""
    with engine(pair, 8, kv_pages=1 + 27) as eng:  # 27 pages x 4 tokens
        preempted = []
        real = eng.scheduler.schedule

        def schedule(*args, **kwargs):
            sched = real(*args, **kwargs)
            preempted.extend((r.rid, len(r.output)) for r in sched.preempted)
            return sched

        eng.scheduler.schedule = schedule
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        rids = [eng.add_request(p, params) for p in PROMPTS[:2]]
        while len(eng.requests[rids[0]].output) < 10:  # they hold 11 pages: the long prompt's 16 fit, just
            eng.step()
        rids.append(eng.add_request(PROMPTS[3], params))
        while eng.has_unfinished():
            eng.step()
        outs = [eng.requests.pop(r).output for r in rids]
        assert ("req-2", 0) in preempted  # before its first token: mid-prefill (a running request has one)
        assert eng.allocator.num_free == eng.allocator.capacity_pages
    with engine(pair, -1) as eng:
        assert [r.output_token_ids for r in eng.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]], params)] == outs


def test_context_length_serves_below_the_model_maximum(pair):
    most = pair.target.max_position_embeddings
    with pytest.raises(ConfigError, match="exceeds the model's maximum"):
        LLMEngine(EngineConfig(model=str(pair.target_dir), context_length=most + 1))
    with engine(pair, 8, context_length=48) as eng:
        with pytest.raises(ConfigError, match="served context is 48"):
            eng.add_request(random_prompt(330, 48), GREEDY)
        out = eng.generate([PROMPTS[2]], SamplingParams(max_new_tokens=100, ignore_eos=True))[0]
        assert out.finish_reason == "length" and len(PROMPTS[2]) + len(out.output_token_ids) == 48
    with engine(pair, 8, kv_pages=1 + 8) as eng:  # a prompt longer than the whole KV cache: refused at once
        with pytest.raises(OutOfPagesError, match="can never fit"):
            eng.add_request(random_prompt(331, 40), GREEDY)


def test_flags_reach_the_engine_config(pair):
    from tandem.cli import build_parser, generate_settings
    from verifier.__main__ import build_parser as verifier_parser
    from verifier.config import VerifierConfig

    flags = ["--chunked-prefill-size", "512", "--context-length", "100"]
    args = verifier_parser().parse_args(["--model", str(pair.target_dir), *flags])
    engine_cfg = VerifierConfig.from_args(args, args.model).engine
    assert (engine_cfg.chunked_prefill_size, engine_cfg.context_length) == (512, 100)
    cfg, _ = generate_settings(build_parser().parse_args(["generate", "--prompt-token-ids", "1", "--max-new-tokens",
                                                          "1", "--model", str(pair.target_dir), *flags]))
    assert (cfg.chunked_prefill_size, cfg.context_length) == (512, 100)
    with pytest.raises(ConfigError, match="chunked-prefill-size"):
        EngineConfig(model="x", chunked_prefill_size=0)
