"""The gateway's stream (gateway/generation.py) gives the same answer however the verifier's tokens are grouped
into messages — one a message, a round's few, or many that queued behind a slow client (verifier/server.py):
stop strings found past min_tokens and never before, the tokens after a stop string neither counted nor given
log-probabilities, a stop string split across messages still caught. Against the one-token-a-message answer,
which is the rule's direct reading (vLLM's)."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from unittest.mock import MagicMock

import grpc
import pytest

from gateway.generation import GenerationStream
from tandem.rpc.verifier.v1 import verifier_pb2 as pb

CHARS = "ab\ncd<|e"
decode = lambda ids: "".join(CHARS[i] for i in ids)  # noqa: E731


class _Call:
    def __init__(self, msgs):
        self.msgs = list(msgs)

    async def read(self):
        return self.msgs.pop(0) if self.msgs else grpc.aio.EOF

    def cancel(self):
        pass


def _answer(tokens: list[int], sizes: list[int], min_tokens: int, stop: list[str]):
    """The stream's (text, finish, completion tokens, log-probabilities' tokens) for ``tokens`` sent in
    messages of ``sizes`` tokens, the last one finishing with "length"."""
    msgs, at = [], 0
    for n in sizes:
        part = tokens[at:at + n]
        at += n
        msgs.append(pb.GenerateResponse(token_ids=part, completion_tokens=at,
                                        finish_reason="length" if at == len(tokens) else "",
                                        logprobs=[pb.TokenLogprobs(logprob=-float(t)) for t in part]))
    req = SimpleNamespace(prompt_ids=[0, 1], stop=stop, include_stop_str_in_output=False, stop_token_ids=[],
                          max_tokens=len(tokens), min_tokens=min_tokens, logprobs=0, prompt_logprobs=None,
                          prompt_only=False, to_proto=lambda: None)
    stream = GenerationStream(req, SimpleNamespace(generate=lambda *a: _Call(msgs), address="x"), decode,
                              MagicMock(), MagicMock(), 0.0)

    async def read():
        return [d async for d in stream]

    deltas = asyncio.run(read())
    logprob_tokens = [-int(e.logprob) for d in deltas for e in (d.logprobs or [])]
    return "".join(d.text for d in deltas), deltas[-1].finish_reason, deltas[-1].completion_tokens, logprob_tokens


def _sizes(n: int, rng: random.Random) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(min(rng.randint(1, 6), n - sum(sizes)))
    return sizes


@pytest.mark.parametrize("seed", range(40))
def test_the_answer_does_not_depend_on_how_tokens_are_grouped(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(len(CHARS)) for _ in range(rng.randint(3, 24))]
    min_tokens = rng.choice([0, 0, 2, 5, 9])
    stop = rng.choice([["\n"], ["cd"], ["<|e"], ["d<", "b"], []])
    one_each = _answer(tokens, [1] * len(tokens), min_tokens, stop)
    assert _answer(tokens, _sizes(len(tokens), rng), min_tokens, stop) == one_each
    assert _answer(tokens, [len(tokens)], min_tokens, stop) == one_each


def test_a_stop_string_inside_min_tokens_is_not_one_and_tokens_past_a_stop_are_not_counted():
    tokens = [0, 1, 2, 3, 4, 5, 6, 2, 0]  # "ab\ncd<|\na"
    assert _answer(tokens, [9], 4, ["\n"]) == ("ab\ncd<|", "stop", 8, [0, 1, 2, 3, 4, 5, 6, 2])
    assert _answer(tokens, [9], 0, ["\n"]) == ("ab", "stop", 3, [0, 1, 2])
