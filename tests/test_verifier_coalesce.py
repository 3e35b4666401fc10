"""The verifier's stream coalesces the outputs that queue up behind a slow client into one message
(verifier/server.py): the tokens in order, the logprobs with them, the finish and the totals of the last, the
prompt's logprobs and cached count of the first; nothing read past a finish; an engine failure passes."""

from __future__ import annotations

import asyncio

from tandem.engine.step import StepOutput
from tandem.engine.request import FinishReason
from tandem.logprobs import TokenLogprobs
from verifier.server import MAX_COALESCED_TOKENS, _coalesced


def _queue(*items) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    return q


def _lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(logprob=-float(token), top=[(token, -float(token))])


def test_queued_outputs_go_as_one_message_up_to_the_finish():
    first = StepOutput("r", [1, 2], None, logprobs=[_lp(1), _lp(2)], prompt_logprobs=[_lp(9)], cached_tokens=16)
    second = StepOutput("r", [3], None, drafted=3, round_accepts=[2], logprobs=[_lp(3)])
    last = StepOutput("r", [4], FinishReason.LENGTH, logprobs=[_lp(4)])
    after = StepOutput("r", [5], None)
    q = _queue(second, last, after)
    out = _coalesced(first, q)
    assert out.new_token_ids == [1, 2, 3, 4] and out.finish_reason == FinishReason.LENGTH
    assert [e.logprob for e in out.logprobs] == [-1, -2, -3, -4] and out.prompt_logprobs == [_lp(9)]
    assert out.cached_tokens == 16 and out.drafted == 3 and out.round_accepts == [2]
    assert q.qsize() == 1  # nothing read past the finish


def test_nothing_queued_leaves_the_output_alone_and_a_failure_passes():
    lone = StepOutput("r", [7], None)
    assert _coalesced(lone, _queue()) is lone
    failure = RuntimeError("engine died")
    assert _coalesced(StepOutput("r", [1], None), _queue(failure)) is failure


def test_a_coalesced_message_stops_growing_at_its_cap():
    q = _queue(*[StepOutput("r", list(range(100)), None) for _ in range(30)])
    out = _coalesced(StepOutput("r", [0], None), q)
    assert MAX_COALESCED_TOKENS <= len(out.new_token_ids) < MAX_COALESCED_TOKENS + 100 and not q.empty()


def test_a_paced_message_takes_what_comes_until_its_time_and_no_later_than_the_finish():
    from verifier.server import _paced

    async def scenario(last_reason):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        loop.call_later(0.02, q.put_nowait, StepOutput("r", [2], None))
        loop.call_later(0.04, q.put_nowait, StepOutput("r", [3], last_reason))
        loop.call_later(0.3, q.put_nowait, StepOutput("r", [4], None))
        started = loop.time()
        out = await _paced(StepOutput("r", [1], None), q, until=started + (1.0 if last_reason else 0.1))
        return out, loop.time() - started, q

    out, took, q = asyncio.run(scenario(FinishReason.LENGTH))
    assert out.new_token_ids == [1, 2, 3] and out.finish_reason == FinishReason.LENGTH and took < 0.25
    out, took, q = asyncio.run(scenario(None))  # its time comes first: what came by then, the rest later
    assert out.new_token_ids == [1, 2, 3] and out.finish_reason is None and 0.09 <= took < 0.25
