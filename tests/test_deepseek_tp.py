"""DeepSeek-V3 (MLA + MoE) under tensor parallelism on the CPU (gloo): q_b/kv_b split by heads, o and
the experts' down projections reduced, the latent cache whole on every rank — at TP 2, 4 and 8 (at 8, one
head per rank; 4 and 8 on a 4-layer twin), against transformers: prompt and packed logits, greedy output,
EAGLE-3 features and a tree's logits; at TP 2 also runs of decode steps on the MLA graph backend's static
path, and a DeepSeek-V2-style model (q_proj by heads, fused with kv_a). Runs in tests/tp_runner.py's child
process under a timeout, as test_tp.py does."""

from __future__ import annotations

import pytest
import torch

from deepseek_checkpoints import write_deepseek
from helpers import assert_rel, hf_greedy, hf_hidden_states, hf_logits, random_prompt, run_tp_jobs

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("procs")]  # TP ranks under gloo: one at a time (conftest.py)

TIMEOUT_S = 400
VOCAB = 512
PROMPTS = [random_prompt(70, 11, VOCAB), random_prompt(71, 26, VOCAB)]
MAX_NEW = 12
TREE_PARENTS = [-1, 0, 0, 1, 2]
TP_SIZES = (2, 4, 8)
# TP 4 and 8 run a 4-layer twin (1 dense + 3 MoE layers, the same seed): at those sizes a step's cost is its
# collectives (two a layer, 8 ranks on 2 cores). TP 2 runs the 8 layers whose default capture is 3 distinct layers.
LAYERS = {2: 8, 4: 4, 8: 4}
CAPTURE = {8: (2, 4, 5), 4: (1, 2, 2)}  # EAGLE-3's default [2, N//2, N-3] by depth (clamped at 4: a layer twice)
QUEUED_NEW = 6  # runs of decode steps on the latent graph path (interpreted Triton): the first 6 tokens, a run of 4


def tree_job(prompt: list[int]) -> dict:
    prefix, tokens = prompt[:-1], [prompt[-1], 40, 41, 42, 43]
    depth, mask = [], []
    for i, parent in enumerate(TREE_PARENTS):
        depth.append(0 if parent == -1 else depth[parent] + 1)
        mask.append([j in _path(i) for j in range(len(TREE_PARENTS))])
    return dict(prefix=prefix, tokens=tokens, positions=[len(prefix) + d for d in depth], mask=mask)


def _path(node: int) -> list[int]:
    out = []
    while node != -1:
        out.append(node)
        node = TREE_PARENTS[node]
    return out[::-1]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    """The module's TP runs, the V2-style model's too, in one runner (its start and its fork server's cost seconds)
    → (transformers models by folder, results by TP size and "v2")."""
    work = tmp_path_factory.mktemp("deepseek-tp")
    hf = {f"model-{n}": write_deepseek(work / f"model-{n}", seed=31, num_hidden_layers=n)
          for n in set(LAYERS.values())}
    hf["v2"] = write_deepseek(work / "v2", seed=32, q_lora_rank=None)
    spec = [dict(model=str(work / f"model-{LAYERS[tp]}"), tp_size=tp, prompts=PROMPTS, max_new_tokens=MAX_NEW,
                 tree=tree_job(PROMPTS[1]), decode_steps=4 if tp == 2 else None, queued_new_tokens=QUEUED_NEW)
            for tp in TP_SIZES]
    spec.append(dict(model=str(work / "v2"), tp_size=2, prompts=PROMPTS, max_new_tokens=MAX_NEW))
    return hf, dict(zip([*TP_SIZES, "v2"], run_tp_jobs(spec, work, TIMEOUT_S, "the DeepSeek TP runs")))


@pytest.mark.parametrize("tp", TP_SIZES)
def test_tp_matches_hf(tp_results, tp):
    hfs, results = tp_results
    hf, res = hfs[f"model-{LAYERS[tp]}"], results[tp]
    assert res["local_heads"] == 8 // tp and res["local_vocab"] == VOCAB // tp
    assert res["qkv_a_rows"] == 32 + 24  # q_a (q_lora 32) and kv_a (kv_lora 16 + rope 8), whole on every rank
    assert res["children_left"] == [] and res["pages_back"]
    for prompt, logits in zip(PROMPTS, res["prompt_logits"]):
        assert_rel(logits, hf_logits(hf, prompt), 1e-4, "prompt")
    assert_rel(res["packed_logits"], torch.cat([hf_logits(hf, p) for p in PROMPTS]), 1e-4, "packed")
    assert res["greedy"] == [hf_greedy(hf, p, MAX_NEW - 3 * i) for i, p in enumerate(PROMPTS)]
    capture = CAPTURE[LAYERS[tp]]  # the features are the inputs of these layers
    want = torch.cat([torch.cat([hf_hidden_states(hf, p)[i] for i in capture], dim=-1) for p in PROMPTS])
    assert_rel(res["features"], want, 1e-4, "features")
    tree = tree_job(PROMPTS[1])
    for node, row in enumerate(res["tree_logits"]):
        path = [tree["tokens"][j] for j in _path(node)]
        assert_rel(row, hf_logits(hf, tree["prefix"] + path)[-1], 1e-4, f"tree node {node}")



def test_tp2_runs_of_decode_steps_on_the_latent_graph_path_keep_the_output(tp_results):
    """Runs of 4 decode steps on the MLA graph backend's static path, rank 1 following rank 0's runs."""
    _, results = tp_results
    res = results[2]
    assert res["queued_most_steps"] == 4 and res["queued_pages_back"]
    assert res["queued"] == [[out[:QUEUED_NEW] for out in res["greedy"]], [res["sampled"][:QUEUED_NEW]]]


@pytest.fixture(scope="module")
def v2_tp2(tp_results):
    hfs, results = tp_results
    return hfs["v2"], results["v2"]


def test_tp2_v2_style_q_proj_fused_with_kv_a_matches_hf(v2_tp2):
    """Without q_lora, each rank's fused input projection holds its heads' q_proj rows and all of kv_a."""
    hf, res = v2_tp2
    assert res["local_heads"] == 4 and res["qkv_a_rows"] == 4 * 24 + 24  # its heads' q (nope + rope), kv_lora + rope
    for prompt, logits in zip(PROMPTS, res["prompt_logits"]):
        assert_rel(logits, hf_logits(hf, prompt), 1e-4, "prompt")
    assert res["greedy"] == [hf_greedy(hf, p, MAX_NEW - 3 * i) for i, p in enumerate(PROMPTS)]
