"""Where a request's emitted tokens end (tandem.engine.request.tokens_until_finish, what the engine's commit keeps of a
run): against the rule checked token by token — append, then a stop token (end-of-sequence unless ignore_eos, or one
of stop_token_ids) before a length (max_new_tokens, the context, a next step past the whole KV cache)."""

from __future__ import annotations

import random

from tandem.engine.request import FinishReason, Request, tokens_until_finish
from tandem.sampling import SamplingParams

EOS = (2, 7)


def _one_at_a_time(tokens, prompt_len, output_len, params, context_len, capacity_pages, page):
    new = []
    for token in tokens:
        new.append(token)
        n, out = prompt_len + output_len + len(new), output_len + len(new)
        if (not params.ignore_eos and token in EOS) or token in params.stop_token_ids:
            return new, FinishReason.STOP
        if out >= params.max_new_tokens or n >= context_len or -(-n // page) > capacity_pages:
            return new, FinishReason.LENGTH
    return new, None


def test_tokens_until_finish_matches_the_rule_token_by_token():
    rng = random.Random(0)
    reasons = set()
    for case in range(6000):
        prompt_len, output_len, page = rng.randint(1, 40), rng.randint(0, 30), rng.choice((1, 3, 16))
        # limits ahead, reached by these tokens, or already reached (a request the engine should not hold; the rule
        # still says what it would keep)
        params = SamplingParams(max_new_tokens=max(1, output_len + rng.randint(-2, 12)), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=tuple(rng.sample(range(20), rng.randint(0, 2))))
        context_len = prompt_len + output_len + rng.randint(-2, 14)
        capacity_pages = max(1, -(-(prompt_len + output_len) // page) + rng.randint(-1, 1))
        tokens = [rng.randrange(20) for _ in range(rng.randint(0, 9))]
        req = Request(f"r{case}", [1] * prompt_len, params, 0, None, output=[3] * output_len)
        got = tokens_until_finish(tokens, req, EOS, context_len, capacity_pages * page)
        want = _one_at_a_time(tokens, prompt_len, output_len, params, context_len, capacity_pages, page)
        assert got == want, (case, tokens, prompt_len, output_len, params, context_len, capacity_pages, page)
        reasons.add(want[1])
    assert reasons == {None, FinishReason.STOP, FinishReason.LENGTH}
