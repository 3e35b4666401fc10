"""Several plain decode steps queued per engine step (``--decode-steps``, tandem.engine.decode_ahead):
the tokens are those of one-step decoding (greedy: also HF's), seeded sampling draws the same tokens,
a stop token mid-way truncates the output and releases every page, and a prompt that arrives is
admitted at the next step, not after a run of queued steps."""

from __future__ import annotations

import pytest

from helpers import hf_greedy, random_prompt
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.errors import ConfigError
from tandem.sampling import SamplingParams

LENGTHS = [3, 17, 9]
MAX_NEW = [13, 6, 21]  # not multiples of the steps: the last run of each request is shorter


def _run(path: str, decode_steps: int, params: list[SamplingParams]) -> tuple[list[list[int]], list[list[int]], int]:
    """→ (each prompt's output, the number of new tokens per step per request, free pages at the end)."""
    with LLMEngine(EngineConfig(model=path, decode_steps=decode_steps, page_size=4)) as eng:
        free_before = eng.allocator.num_free
        rids = [eng.add_request(random_prompt(10 + i, n), p) for i, (n, p) in enumerate(zip(LENGTHS, params))]
        per_step: list[list[int]] = []
        while eng.has_unfinished():
            per_step.append([len(o.new_token_ids) for o in eng.step()])
        outputs = [eng.requests.pop(r).output for r in rids]
        assert eng.allocator.num_free == free_before  # every page reserved ahead came back
        return outputs, per_step, free_before


def test_greedy_tokens_equal_one_step_decoding_and_hf(llama):
    greedy = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    one, one_steps, _ = _run(llama.path, 1, greedy)
    four, four_steps, _ = _run(llama.path, 4, greedy)
    assert four == one
    for i, n in enumerate(LENGTHS):
        assert four[i] == hf_greedy(llama.hf, random_prompt(10 + i, n), MAX_NEW[i])
    # the prefill step emits one token per request; then runs of up to 4 (fewer at a request's budget)
    assert max(max(s) for s in four_steps[1:]) == 4
    assert len(four_steps) < len(one_steps) / 2


def test_a_request_at_its_budget_does_not_cut_the_others_run(llama):
    """The request with 6 new tokens ends inside the second run: it takes what it has left (1), the others
    take a whole run in that step (the rest of its run is computed and dropped), not a run cut to one."""
    greedy = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    four, four_steps, _ = _run(llama.path, 4, greedy)
    assert [len(o) for o in four] == MAX_NEW
    done = 0
    for counts in four_steps:  # the step where the second request reaches its 6 tokens
        done += counts[1]
        if done == MAX_NEW[1]:
            break
    assert counts[1] < 4 and counts[0] == counts[2] == 4, four_steps


def test_seeded_sampling_draws_the_same_tokens(llama):
    sampled = [SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_new_tokens=MAX_NEW[0], ignore_eos=True),
               SamplingParams(temperature=1.0, top_k=20, seed=8, max_new_tokens=MAX_NEW[1], ignore_eos=True),
               SamplingParams(max_new_tokens=MAX_NEW[2], ignore_eos=True)]  # a greedy row in a sampled batch
    one, _, _ = _run(llama.path, 1, sampled)
    three, _, _ = _run(llama.path, 3, sampled)
    assert three == one
    assert len(set(one[0])) > 1  # sampling really happened


def test_a_stop_token_mid_run_truncates_and_frees_pages(llama):
    greedy = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    reference, _, _ = _run(llama.path, 1, greedy)
    stop = reference[2][6]  # the 7th token of the third request: inside its second run of four
    first = reference[2].index(stop)
    params = greedy[:2] + [SamplingParams(max_new_tokens=MAX_NEW[2], ignore_eos=True, stop_token_ids=(stop,))]
    outputs, _, _ = _run(llama.path, 4, params)  # (asserts every page came back)
    assert outputs[2] == reference[2][: first + 1]
    assert outputs[:2] == reference[:2]  # the others go on, unaffected


def test_a_new_prompt_is_admitted_at_the_next_step(llama):
    with LLMEngine(EngineConfig(model=llama.path, decode_steps=8)) as eng:
        first = eng.add_request(random_prompt(1, 5), SamplingParams(max_new_tokens=40, ignore_eos=True))
        eng.step()  # prefill
        assert [len(o.new_token_ids) for o in eng.step()] == [8]
        eng.add_request(random_prompt(2, 7), SamplingParams(max_new_tokens=4, ignore_eos=True))
        outs = eng.step()
        assert eng.last_step.num_prefill == 1  # not queued behind another run of eight
        assert {o.rid: len(o.new_token_ids) for o in outs}[first] == 1


def test_decode_steps_and_spec_rounds_are_validated(llama):
    with pytest.raises(ConfigError, match="decode-steps"):
        EngineConfig(model=llama.path, decode_steps=0)
    with pytest.raises(ConfigError, match="spec-rounds"):
        EngineConfig(model=llama.path, spec_rounds=0)
