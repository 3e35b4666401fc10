"""--logprobs-mode processed_logprobs (vLLM's): the log of the distribution a request samples from at each
generated position — the repetition penalty, then temperature, min_p, top-k and top-p — against a reference
written here from those definitions over transformers' logits on the same weights; target-only (one step at
a time and with decode steps queued, which such requests leave for the host) and speculating. The default
(raw_logprobs) is checked against transformers' log-softmax in test_sampling_fields."""

from __future__ import annotations

import math

import pytest
import torch

from checkpoints import write_checkpoint
from helpers import hf_logits, random_prompt
from proposers import RandomTreeProposer, Spec, always_speculate
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.errors import ConfigError
from tandem.sampling import SamplingParams

TOP = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("processed") / "llama"
    return path, write_checkpoint(path, "llama", seed=13, num_hidden_layers=2)


def reference(logits: torch.Tensor, history: list[int], p: SamplingParams) -> torch.Tensor:
    """log-probabilities of one position from the definitions (vLLM's order): repetition penalty over the
    prompt and output so far (positive logits divided, negative multiplied), temperature, min_p (drop below
    min_p x the largest probability), top-k, top-p (the smallest most-likely set whose mass reaches p)."""
    x = logits.double().clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(history)))
        x[seen] = torch.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
    x = x / p.temperature
    probs = x.softmax(-1)
    x[probs < p.min_p * probs.max()] = -math.inf
    if p.top_k > 0:
        x[x < x.topk(p.top_k).values[-1]] = -math.inf
    probs = x.softmax(-1)
    ordered, order = probs.sort(descending=True)
    before = ordered.cumsum(0) - ordered  # mass of the more likely tokens
    x[order[before >= p.top_p]] = -math.inf
    return x.log_softmax(-1)


@pytest.mark.parametrize("mode", ["target-only", "decode-ahead", "speculating"])
def test_processed_logprobs_are_those_of_the_sampled_distribution(target, mode):
    path, hf = target
    prompts = [random_prompt(40 + i, n) for i, n in enumerate((6, 11))]
    penalty = 1.3
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=penalty, seed=5,
                            max_new_tokens=16, ignore_eos=True, logprobs=TOP)
    cfg = EngineConfig(model=str(path), page_size=4, logprobs_mode="processed_logprobs",
                       decode_steps=4 if mode == "decode-ahead" else None)
    proposer = RandomTreeProposer(256, seed=2) if mode == "speculating" else None
    with LLMEngine(cfg, proposer=proposer, spec=Spec(6) if proposer else None,
                   policy=always_speculate()) as eng:
        rids = [eng.add_request(prompt, params) for prompt in prompts]
        got = {rid: ([], []) for rid in rids}
        while eng.has_unfinished():
            for out in eng.step():
                got[out.rid][0].extend(out.new_token_ids)
                got[out.rid][1].extend(out.logprobs)
        if mode == "speculating":
            assert all(eng.requests[rid].spec_stats.rounds > 0 for rid in rids)
    for prompt, rid in zip(prompts, rids):
        output, entries = got[rid]
        logits = hf_logits(hf, prompt + output)
        for j, (token, entry) in enumerate(zip(output, entries)):
            ref = reference(logits[len(prompt) - 1 + j], prompt + output[:j], params)
            assert math.isfinite(entry.logprob) and abs(entry.logprob - ref[token].item()) <= 2e-3
            values, ids = ref.topk(TOP)
            assert [t for t, _ in entry.top] == ids.tolist()
            assert all(abs(v - r) <= 2e-3 or v == r for (_, v), r in zip(entry.top, values.tolist()))


def test_the_mode_is_checked(target):
    with pytest.raises(ConfigError, match="--logprobs-mode"):
        EngineConfig(model=str(target[0]), logprobs_mode="processed")
