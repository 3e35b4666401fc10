"""Tensor parallelism wider than the KV heads, on the CPU (gloo): a Llama with 8 query heads and 2 KV heads at
TP 4 and TP 8, where each rank holds 2 or 1 query heads and a replicated KV head, against transformers (prompt
logits, packed logits, greedy output) and the seeded sampled output of TP 1. Runs in tests/tp_runner.py's child
process under a timeout, as test_tp.py does."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rel, hf_greedy, hf_logits, random_prompt, run_tp_jobs

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("procs")]  # TP ranks under gloo: one at a time (conftest.py)

TIMEOUT_S = 400
VOCAB = 256
PROMPTS = [random_prompt(93, 9, VOCAB), random_prompt(94, 21, VOCAB)]
MAX_NEW = 10
TP_SIZES = (1, 4, 8)


@pytest.fixture(scope="module")
def wide(checkpoint, tmp_path_factory):
    ckpt = checkpoint("llama", 23, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2)
    spec = [dict(model=ckpt.path, tp_size=tp, prompts=PROMPTS, max_new_tokens=MAX_NEW) for tp in TP_SIZES]
    results = run_tp_jobs(spec, tmp_path_factory.mktemp("tp-wide"), TIMEOUT_S, "the wide TP run")
    return ckpt.hf, dict(zip(TP_SIZES, results))


@pytest.mark.parametrize("tp", [4, 8])
def test_tp_wider_than_the_kv_heads_matches_hf_and_tp1(wide, tp):
    hf, results = wide
    res = results[tp]
    assert (res["local_heads"], res["local_kv_heads"]) == (8 // tp, 1)  # one KV head each, replicated
    assert res["children_left"] == [] and res["pages_back"]
    for prompt, logits in zip(PROMPTS, res["prompt_logits"]):
        assert_rel(logits, hf_logits(hf, prompt), 1e-4, "prompt")
    assert_rel(res["packed_logits"], torch.cat([hf_logits(hf, p) for p in PROMPTS]), 1e-4, "packed")
    assert res["greedy"] == [hf_greedy(hf, p, MAX_NEW - 3 * i) for i, p in enumerate(PROMPTS)]
    assert res["sampled"] == results[1]["sampled"]
