"""Prompts prefilled apart from the running requests' step (the default with CUDA graphs; forced here on
the CPU with ``mixed_prefill=False``): greedy output identical to the mixed steps' (target-only, chains,
trees, chunked prompts), a step that prefills carries no decoding rows and is followed by the running
requests' decoding for as long as it took (prompts that arrive meanwhile go together), pages for the
running requests' next step are left free, and the flag."""

from __future__ import annotations

import pytest

from helpers import random_prompt
from test_chunked_prefill import GREEDY, PROMPTS, engine, staggered
from tandem.speculative.spec_config import SpecConfig


@pytest.fixture(scope="module")
def mixed(pair):
    with engine(pair, -1) as eng:
        return staggered(eng, GREEDY)


@pytest.mark.parametrize("chunk", (-1, 7))
def test_target_only_greedy_is_unchanged_by_prompts_apart(pair, mixed, chunk):
    with engine(pair, chunk, mixed_prefill=False) as eng:
        assert eng.prefill_apart
        assert staggered(eng, GREEDY) == mixed


@pytest.mark.parametrize("spec,chunk", [(SpecConfig(3, 1, 4), -1), (SpecConfig(3, 2, 6), 7), (SpecConfig(2, 3, 7), 16)])
def test_speculative_greedy_is_unchanged_by_prompts_apart(pair, mixed, spec, chunk):
    with engine(pair, chunk, spec, mixed_prefill=False) as eng:
        assert staggered(eng, GREEDY) == mixed


def test_a_step_that_prefills_has_no_decoding_rows_and_the_next_one_decodes(pair):
    with engine(pair, 8, SpecConfig(3, 1, 4), mixed_prefill=False) as eng:
        from tandem.sampling import SamplingParams

        kinds = []
        long_streams = SamplingParams(max_new_tokens=120, ignore_eos=True)  # they outlive the 8 chunks
        streams = [eng.add_request(p, long_streams) for p in PROMPTS[:2]]
        while not all(eng.requests[rid].output for rid in streams):  # their own prompts: chunks of 8
            eng.step()
        eng.add_request(PROMPTS[3], GREEDY)  # 64 tokens: 8 chunks of 8
        while not eng.requests["req-2"].output:
            eng.step()
            info = eng.last_step
            kinds.append((info.num_prefill, info.num_decode))
        # never both in one step, and the running requests decode between two chunks (at least as long as a
        # chunk took: StepAccounting.decode_owed_s)
        assert all(not (p and d) for p, d in kinds)
        prefilled = [bool(p) for p, _ in kinds]
        assert not any(a and b for a, b in zip(prefilled, prefilled[1:]))
        assert sum(1 for p, _ in kinds if p) == 8
        while eng.has_unfinished():
            eng.step()
        assert all(len(eng.requests[r].output) == long_streams.max_new_tokens for r in streams)
        assert eng.allocator.num_free == eng.allocator.capacity_pages


def test_a_prompt_waits_when_the_running_requests_need_its_pages(pair):
    """Prompts apart must not take the pages the running requests' next step needs (they would only be
    preempted right after): with the pool nearly full, the prompt waits and nobody is preempted."""
    from tandem.sampling import SamplingParams

    with engine(pair, -1, kv_pages=1 + 20, mixed_prefill=False) as eng:  # 20 pages x 4 tokens
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        first = eng.add_request(PROMPTS[3], params)  # 64 tokens: 17 pages with its first token
        eng.step()
        eng.add_request(random_prompt(340, 14), params)  # 4 pages: the 4 left, one of which the first needs next
        while eng.has_unfinished():
            eng.step()
        assert eng.scheduler.preemptions == 0
        assert len(eng.requests[first].output) == 16


def test_the_flag_reaches_the_engine_config(pair):
    from verifier.__main__ import build_parser
    from verifier.config import VerifierConfig

    args = build_parser().parse_args(["--model", str(pair.target_dir), "--enable-mixed-chunk"])
    assert VerifierConfig.from_args(args, args.model).engine.mixed_prefill is True
    args = build_parser().parse_args(["--model", str(pair.target_dir)])
    assert VerifierConfig.from_args(args, args.model).engine.mixed_prefill is None
    with engine(pair, -1) as eng:  # without CUDA graphs there is nothing to keep apart for
        assert not eng.prefill_apart



def test_the_policy_learns_what_arrivals_cost_the_drafter(pair):
    """Prompts prefilled apart while speculating: every prompt token's extension is reported to the policy
    (with the seconds its step spent extending), and every finished request's prompt and output lengths."""
    from tandem.speculative.policy import PolicyConfig, SpeculationPolicy

    class Recording(SpeculationPolicy):
        def __init__(self):
            super().__init__(PolicyConfig(enabled=False))
            self.arrivals, self.finished = [], []

        def observe_arrivals(self, prompt_tokens, seconds):
            self.arrivals.append((prompt_tokens, seconds))
            super().observe_arrivals(prompt_tokens, seconds)

        def observe_finished(self, prompt_tokens, output_tokens):
            self.finished.append((prompt_tokens, output_tokens))
            super().observe_finished(prompt_tokens, output_tokens)

    policy = Recording()
    with engine(pair, -1, SpecConfig(3, 1, 4), policy=policy, mixed_prefill=False) as eng:
        staggered(eng, GREEDY)
    assert sum(tokens for tokens, _ in policy.arrivals) == sum(len(p) for p in PROMPTS)
    assert all(seconds > 0 for _, seconds in policy.arrivals)
    assert sorted(policy.finished) == sorted((len(p), GREEDY.max_new_tokens) for p in PROMPTS)
    assert policy.arrival_cost_per_output_token() > 0


@pytest.mark.parametrize("spec", [SpecConfig(3, 1, 4), SpecConfig(3, 2, 6)])
def test_a_second_turn_on_cached_pages_with_prompts_apart(pair, spec):
    """A second turn (the first's prompt and answer, then more) starts on the prefix cache's pages while
    another request decodes: prompts apart and the cache together give the target-only greedy tokens."""
    from tandem.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    first = PROMPTS[3]
    with engine(pair, -1, enable_prefix_caching=False) as eng:
        answer = eng.generate([first], params)[0].output_token_ids
        second = first + answer + PROMPTS[1]
        want = [r.output_token_ids for r in eng.generate([PROMPTS[2], second], params)]
    with engine(pair, 8, spec, mixed_prefill=False) as eng:
        assert eng.generate([first], params)[0].output_token_ids == answer
        busy = eng.add_request(PROMPTS[2], params)
        eng.step()
        late = eng.add_request(second, params)
        while eng.has_unfinished():
            eng.step()
        assert [eng.requests[busy].output, eng.requests[late].output] == want
        assert eng.requests[late].cached_tokens > 0


def test_prompts_that_arrive_while_decoding_is_owed_go_together(pair):
    """After a step of prompts alone the running requests are owed that long of decoding: prompts that
    arrive meanwhile wait and are prefilled in one step."""
    from tandem.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with engine(pair, -1, mixed_prefill=False) as eng:
        running = eng.add_request(PROMPTS[0], params)
        eng.step()  # alone: nothing to keep apart from
        eng.add_request(PROMPTS[1], params)
        eng.step()  # a step of that prompt alone
        assert eng.last_step.num_prefill == 1 and not eng.last_step.num_decode and eng.accounting.decode_owed_s > 0
        eng.accounting.decode_owed_s = 1e9  # (a long prefill: decoding owed for a while)
        late = [eng.add_request(p, params) for p in PROMPTS[2:]]
        for _ in range(3):
            eng.step()
            assert eng.last_step.num_decode and not eng.last_step.num_prefill  # the late prompts wait
        eng.accounting.decode_owed_s = 0.0  # paid
        eng.step()
        assert eng.last_step.num_prefill == len(late) and not eng.last_step.num_decode  # together
        while eng.has_unfinished():
            eng.step()
        assert len(eng.requests[running].output) == 12


def test_right_after_a_step_of_prompts_alone_the_running_requests_take_one_step_not_a_run(pair):
    """A chunk's step stalls the streams; their next token then comes after one decode step, and runs of
    steps queued ahead resume after it (a stream's gap across a chunk: the chunk plus one step, not a run)."""
    from tandem.sampling import SamplingParams

    streams = SamplingParams(max_new_tokens=200, ignore_eos=True)
    with engine(pair, 8, mixed_prefill=False, decode_steps=4) as eng:
        rids = [eng.add_request(p, streams) for p in PROMPTS[:2]]
        while not all(eng.requests[r].output for r in rids):
            eng.step()
        for _ in range(2):
            eng.step()
        assert eng.last_step.steps == 4  # runs while no prompt waits
        eng.add_request(PROMPTS[3], GREEDY)  # 64 tokens: chunks of 8
        kinds = []
        while not eng.requests["req-2"].output:
            eng.step()
            kinds.append((eng.last_step.num_prefill, eng.last_step.steps))
        after_chunk = [kinds[i + 1] for i, (p, _) in enumerate(kinds[:-1]) if p]
        assert after_chunk and all(p == 0 and steps == 1 for p, steps in after_chunk)
        for r in rids:
            eng.abort(r)
        while eng.has_unfinished():
            eng.step()
