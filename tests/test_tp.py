"""Tensor parallelism on CPU (gloo, two processes) against one process and against HF: kv heads split
across ranks (num_key_value_heads=2) and replicated on both (num_key_value_heads=1), a vocabulary that
does not divide evenly, biases and tied embeddings. The TP engines run in a child process under a
timeout, so a hang fails the test instead of the suite."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draft_checkpoints import make_draft
from helpers import assert_rel, hf_hidden_states, hf_logits, random_prompt, run_tp_jobs
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.configs.model import ModelConfig
from tandem.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("procs")]  # TP ranks under gloo: one at a time (conftest.py)

TIMEOUT_S = 300
CASES = {
    # name: (family, seed, config overrides); all have 4 query heads and 4 layers
    "llama-kv2-split": ("llama", 0, {}),
    "llama-kv1-replicated": ("llama", 21, dict(num_key_value_heads=1, vocab_size=255)),
    "qwen2-kv1-bias-tied": ("qwen2", 22, dict(num_key_value_heads=1, vocab_size=251)),
}
PROMPTS = [random_prompt(90, 13, 251), random_prompt(91, 30, 251), random_prompt(92, 4, 251)]
MAX_NEW = 24
TREE_PARENTS = [-1, 0, 0, 1, 1, 2]
CHUNKED_CASE = "llama-kv2-split"  # also run with prompts prefilled in chunks of 6 (one case: a TP start costs)
QUEUED_NEW = 9  # runs of decode steps on the graphs' static path (interpreted Triton): the first 9 tokens, runs of 4


def tree_job(prompt: list[int]) -> dict:
    prefix, tokens = prompt[:-1], [prompt[-1], 40, 41, 42, 43, 44]
    depth, mask = [], []
    for i, parent in enumerate(TREE_PARENTS):
        depth.append(0 if parent == -1 else depth[parent] + 1)
        row = [False] * len(TREE_PARENTS)
        j = i
        while j != -1:
            row[j] = True
            j = TREE_PARENTS[j]
        mask.append(row)
    return dict(prefix=prefix, tokens=tokens, positions=[len(prefix) + d for d in depth], mask=mask)


@pytest.fixture(scope="module")
def tp_results(checkpoint, tmp_path_factory):
    ckpts = {name: checkpoint(family, seed, **kw) for name, (family, seed, kw) in CASES.items()}
    work = tmp_path_factory.mktemp("tp")
    draft = work / "draft"  # a random EAGLE-3 head on the chunked case's target
    make_draft(draft, ModelConfig.from_dir(ckpts[CHUNKED_CASE].path), seed=4, aux_layer_ids=(0, 1, 2))
    runs = dict(chunked_prefill_size=6, decode_steps=4, queued_new_tokens=QUEUED_NEW, draft=str(draft), spec=[3, 1, 4],
                spec_rounds=3)
    spec = [dict(model=ckpts[name].path, tp_size=2, prompts=PROMPTS, max_new_tokens=MAX_NEW,
                 tree=tree_job(PROMPTS[1]), **(runs if name == CHUNKED_CASE else {}))
            for name in CASES]
    results = run_tp_jobs(spec, work, TIMEOUT_S, "the TP=2 run")
    return {name: (ckpts[name], res) for name, res in zip(CASES, results)}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_shards_the_model(tp_results, case):
    ckpt, res = tp_results[case]
    kv_heads = CASES[case][2].get("num_key_value_heads", 2)
    assert res["local_heads"] == 2  # 4 query heads over 2 ranks
    assert res["local_kv_heads"] == (1 if kv_heads == 1 else kv_heads // 2)
    vocab = CASES[case][2].get("vocab_size", 256)
    assert res["local_vocab"] == -(-vocab // 2)
    assert res["children_left"] == [], "TP worker processes outlived engine.shutdown()"
    assert res["pages_back"]


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_logits_match_hf(tp_results, case):
    ckpt, res = tp_results[case]
    for prompt, logits in zip(PROMPTS, res["prompt_logits"]):
        assert_rel(logits, hf_logits(ckpt.hf, prompt), 1e-4)
    packed = torch.cat([hf_logits(ckpt.hf, p) for p in PROMPTS])
    assert_rel(res["packed_logits"], packed, 1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_generation_matches_tp1(tp_results, case):
    ckpt, res = tp_results[case]
    with LLMEngine(EngineConfig(model=ckpt.path)) as eng:
        greedy = eng.generate(PROMPTS, [SamplingParams(max_new_tokens=MAX_NEW - 3 * i, ignore_eos=True)
                                        for i in range(len(PROMPTS))])
        sampled = eng.generate(PROMPTS[:1], SamplingParams(temperature=1.0, seed=5, max_new_tokens=MAX_NEW,
                                                           ignore_eos=True))
        tp1_logits = eng.prompt_logits(PROMPTS[1])
    assert res["greedy"] == [r.output_token_ids for r in greedy]
    assert res["sampled"] == sampled[0].output_token_ids
    assert_rel(res["prompt_logits"][1], tp1_logits, 1e-4)


def test_tp2_chunked_prefill_keeps_greedy_output(tp_results):
    _, res = tp_results[CHUNKED_CASE]
    assert res["chunked_greedy"] == res["greedy"]


def test_tp2_runs_of_decode_steps_keep_greedy_and_sampled_output(tp_results):
    """Runs of 4 graphed decode steps (the graphs' static path): rank 1 follows rank 0's runs, each step's
    token broadcast on the device; the tokens are one-step decoding's, greedy and seeded-sampled. No run is captured
    as one graph (tandem.engine.run_graphs: one rank only)."""
    _, res = tp_results[CHUNKED_CASE]
    assert res["queued_most_steps"] == 4 and res["queued_pages_back"] and res["run_graph_members"] == 0
    assert res["queued"] == [[out[:QUEUED_NEW] for out in res["greedy"]], [res["sampled"][:QUEUED_NEW]]]


def test_tp2_runs_of_chain_rounds_keep_greedy_output(tp_results):
    """Runs of 3 chain rounds with an in-process EAGLE-3 head (the graphs' static path on both sides): rank 1
    replays each round's verify on the inputs rank 0's draft and accept left, broadcast on the device."""
    _, res = tp_results[CHUNKED_CASE]
    assert res["spec_greedy"] == res["greedy"]
    assert res["spec_most_rounds_a_step"] == 3 and res["spec_rounds"] > 0 and res["spec_pages_back"]


def test_tp2_speculating_second_turns_start_on_both_caches_and_keep_greedy_output(tp_results):
    """Second turns (each prompt, its answer, three more tokens) with the head: they start on the target's
    cached pages (both ranks) and the head's own, and decode as target-only greedy does."""
    _, res = tp_results[CHUNKED_CASE]
    target_hits, head_hits = res["spec_turns_cache_hits"]
    assert target_hits > 0 and head_hits > 0
    assert res["spec_turns_greedy"] == res["turns_greedy"]


def test_tp2_a_head_failing_mid_run_leaves_the_ranks_in_step(tp_results):
    """The head fails once after a run's first round reached rank 1: rank 0 still sends the rest of the run's
    inputs (rank 1 replays every round it was told of), the requests decode on without speculation, and the
    output is greedy's; a rank left waiting would hang the run past its timeout."""
    _, res = tp_results[CHUNKED_CASE]
    assert res["failures_injected"] == 1 and res["spec_after_failure"] == res["greedy"]


def test_tp2_prefix_cache_keeps_greedy_output(tp_results):
    """Second turns on both ranks' cached pages decode as one process with the cache off does."""
    ckpt, res = tp_results[CHUNKED_CASE]
    assert res["turns_cache_hits"] > 0
    with LLMEngine(EngineConfig(model=ckpt.path, page_size=4, enable_prefix_caching=False)) as eng:
        want = eng.generate(res["turns"], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert res["turns_greedy"] == [r.output_token_ids for r in want]


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_features_and_tree_match_hf(tp_results, case):
    ckpt, res = tp_results[case]
    # 4 layers: the default [2, N//2, N-3] clamped into range is layers 1, 2, 2 (three blocks).
    want = torch.cat([torch.cat([hf_hidden_states(ckpt.hf, p)[i] for i in (1, 2, 2)], dim=-1) for p in PROMPTS])
    assert_rel(res["features"], want, 1e-4)
    tree = tree_job(PROMPTS[1])
    for node, row in enumerate(res["tree_logits"]):
        path, j = [], node
        while j != -1:
            path.append(tree["tokens"][j])
            j = TREE_PARENTS[j]
        ref = hf_logits(ckpt.hf, tree["prefix"] + path[::-1])[-1]
        assert_rel(row, ref, 1e-4, f"tree node {node}")


CHECK_DIVISIBILITY = """
import json, multiprocessing, sys
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
try:
    LLMEngine(EngineConfig(model=sys.argv[1], tp_size=3))
    out = dict(error=None)
except Exception as e:
    from tandem.errors import TandemError
    out = dict(error=type(e).__name__, tandem=isinstance(e, TandemError), message=str(e))
out["children_left"] = [p.name for p in multiprocessing.active_children()]
print(json.dumps(out))
"""


def test_tp_size_that_does_not_divide_the_heads_is_a_config_error(checkpoint):
    """4 query heads cannot be split over 3 ranks: a one-line TandemError (which the command line
    prints without a traceback) naming the setting and both numbers, and no rank process left over."""
    ckpt = checkpoint("llama")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-c", CHECK_DIVISIBILITY, ckpt.path], cwd=root, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("engine start with tp_size=3 hung")
    assert proc.returncode == 0, stderr[-3000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["error"] is not None, "tp_size=3 with 4 heads was accepted"
    assert out["children_left"] == []
    msg = out["message"]
    assert "\n" not in msg and msg.startswith("--tp-size 3: the model's 4 attention heads cannot be split 3 ways"), msg
    assert "(sizes that can: 1, 2, 4)" in msg, msg
    assert out["tandem"], f"{out['error']}: {msg} — not a TandemError, so the CLI shows a traceback"


def test_the_tensor_parallel_check_names_the_dimension_that_does_not_split(checkpoint):
    """Before any rank starts: heads, key/value heads (fewer than the ranks: replicated, if they share them evenly),
    the MLP's and the experts' intermediate sizes — each named, with the sizes that would split it."""
    import dataclasses

    from tandem.configs.deepseek import MoeConfig
    from tandem.configs.model import ModelConfig
    from tandem.errors import ConfigError

    base = dataclasses.replace(ModelConfig.from_dir(checkpoint("llama").path), num_heads=8, num_kv_heads=2,
                               intermediate_size=96)
    for tp in (1, 2, 4, 8):
        base.check_tensor_parallel(tp)  # (2 KV heads at TP 4 and 8: replicated)
    moe = MoeConfig(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=36,
                    first_k_dense_replace=0, moe_layer_freq=1, n_group=1, topk_group=1, norm_topk_prob=True,
                    routed_scaling_factor=1.0)
    for changed, tp, named in ((dict(num_heads=6, num_kv_heads=6), 4, "6 attention heads cannot be split 4 ways"),
                               (dict(num_heads=12, num_kv_heads=6), 4, "6 key/value heads cannot be split 4 ways"),
                               (dict(num_kv_heads=3, num_heads=12), 4, "3 key/value heads cannot be shared evenly by 4"),
                               (dict(intermediate_size=100), 8, "MLP intermediate size 100 cannot be split 8 ways"),
                               (dict(moe=moe), 8, "experts' intermediate size 36 cannot be split 8 ways")):
        with pytest.raises(ConfigError) as e:
            dataclasses.replace(base, **changed).check_tensor_parallel(tp)
        assert str(e.value).startswith(f"--tp-size {tp}: the model's {named}"), str(e.value)
