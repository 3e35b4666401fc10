"""On the GPU: the drafter and verifier services — features through the CUDA IPC ring, rounds on the
round lane, each step's Round prefetched — emit exactly the target-only greedy tokens of the in-process
engine on the same device, for the project's trained demo pair (a head whose drafts are accepted, so
the features and extends the drafter receives decide what it proposes).

The demo pair is a folder with target/ and draft/ (TANDEM_DEMO_DIR; default: the pair shipped in
``tandem/demo_pair``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]
SPEC_FLAGS = ["--speculative-num-steps", "5", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "6"]


@pytest.fixture(scope="module")
def demo_pair() -> Path:
    from tandem.training.demo import SHIPPED

    folder = Path(os.environ.get("TANDEM_DEMO_DIR", SHIPPED))
    if not (folder / "draft" / "config.json").exists() or not (folder / "target" / "config.json").exists():
        pytest.skip(f"no trained demo pair in {folder} (set TANDEM_DEMO_DIR)")
    return folder


def held_out_prompts(folder: Path, n: int) -> list[list[int]]:
    prompts_file = folder / "prompts.json"
    if prompts_file.exists():
        return json.loads(prompts_file.read_text())[:n]
    return [[(7 * i + 3 * j) % 250 + 3 for j in range(4 + i)] for i in range(n)]


@pytest.fixture(scope="module")
def reference(demo_pair):
    """Target-only greedy continuations (48 tokens) of 6 held-out prompts, one at a time, as served."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.sampling import SamplingParams

    prompts = held_out_prompts(demo_pair, 6)
    greedy = SamplingParams(max_new_tokens=48, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(demo_pair / "target"), device="cuda", dtype="float32")) as engine:
        outputs = [engine.generate([p], greedy)[0].output_token_ids for p in prompts]
    torch.cuda.empty_cache()
    return prompts, outputs


@pytest.mark.parametrize("spec_rounds", ["4", "1"])
def test_the_service_pair_on_the_gpu_equals_target_only_greedy(demo_pair, reference, tmp_path, spec_rounds):
    """``--spec-rounds 4`` (the default): runs of rounds queued on the device by both processes through
    the round mailbox; 1: one round per step, each step's Round prefetched."""
    from services import Service, generate, read_metrics, wait_for
    from tandem.service_probe import free_port

    target, draft = demo_pair / "target", demo_pair / "draft"
    prompts, reference = reference

    common = ["--device", "cuda", "--dtype", "float32", *SPEC_FLAGS]
    drafter = Service("drafter", ["--model", str(draft), "--target-model", str(target), *common],
                      free_port(), tmp_path / "drafter.log").start(300)
    metrics_port = free_port()
    verifier = Service("verifier", ["--model", str(target), "--drafter", drafter.address, "--draft-model", str(draft),
                                    "--metrics-port", str(metrics_port), "--kv-pages", "1024",
                                    "--speculation-policy", "always", "--spec-rounds", spec_rounds, *common],
                       free_port(), tmp_path / "verifier.log")
    try:
        verifier.start(300)
        wait_for(lambda: read_metrics(metrics_port).get("tandem:drafter_up") == 1.0, 60, "the verifier to reach the drafter")
        accepted = []
        for prompt, expected in zip(prompts, reference):
            tokens, last = generate(verifier.address, prompt, max_new_tokens=48)
            assert tokens == expected, f"service output differs from target-only greedy\n{verifier.log()}"
            accepted.append(last.spec.accept_length_mean)
        m = read_metrics(metrics_port)
        assert m["tandem:drafter_round_lane"] == 1.0, f"rounds not on the round lane\n{verifier.log()}\n{drafter.log()}"
        assert sum(accepted) / len(accepted) > 1.5, f"the trained head's drafts were hardly accepted: {accepted}"
        runs = m.get('tandem:drafter_rounds_total{kind="chain_run"}', 0.0)
        if spec_rounds == "1":
            prefetched = m.get('tandem:drafter_rounds_total{kind="prefetched"}', 0.0)
            assert runs == 0 and prefetched > m.get('tandem:drafter_rounds_total{kind="direct"}', 0.0)
        else:
            assert runs > len(prompts), f"runs of rounds were hardly queued with the drafter: {runs}"
    finally:
        verifier.stop()
        drafter.stop()


def test_a_verifier_running_the_head_in_process_on_the_gpu_equals_target_only_greedy(demo_pair, reference, tmp_path):
    """--drafter in-process: the head's graphs in the verifier's pool, the chain's tokens left on the
    device for the verify (the in-process engine's path), served over gRPC."""
    from services import Service, generate
    from tandem.service_probe import free_port

    prompts, reference = reference
    verifier = Service("verifier", ["--model", str(demo_pair / "target"), "--drafter", "in-process",
                                    "--draft-model", str(demo_pair / "draft"), "--kv-pages", "1024",
                                    "--speculation-policy", "always", "--device", "cuda", "--dtype", "float32",
                                    *SPEC_FLAGS], free_port(), tmp_path / "verifier.log")
    try:
        verifier.start(300)
        accepted = []
        for prompt, expected in zip(prompts, reference):
            tokens, last = generate(verifier.address, prompt, max_new_tokens=48)
            assert tokens == expected, f"service output differs from target-only greedy\n{verifier.log()}"
            accepted.append(last.spec.accept_length_mean)
        assert sum(accepted) / len(accepted) > 1.5, f"the trained head's drafts were hardly accepted: {accepted}"
    finally:
        verifier.stop()


def test_a_graphed_head_whose_chain_comes_back_nan_costs_speculation_not_the_engine(demo_pair, reference):
    """The in-process head leaves its chain's tokens on the device for the verify (deferred); a NaN in
    them shows only after the verify has read them. The engine must then emit the root's token and
    decode that request on without speculation: outputs stay target-only greedy."""
    from tandem.engine.config import EngineConfig
    from tandem.sampling import SamplingParams
    from tandem.speculative.spec_config import SpecConfig
    from proposers import always_speculate
    from tandem.engine.speculative_setup import speculative_engine

    prompts, expected = reference
    cfg = EngineConfig(model=str(demo_pair / "target"), device="cuda", dtype="float32", cuda_graph_max_bs=8,
                       kv_pages=1024)  # not sized by free memory: the services of the tests before may still be exiting
    engine = speculative_engine(cfg, str(demo_pair / "draft"), SpecConfig(5, 1, 6),
                                policy=always_speculate())  # every step drafts
    with engine:
        assert engine.proposer.graphs is not None and engine.proposer.cfg.defer_chain_tokens
        rid = engine.add_request(prompts[0], SamplingParams(max_new_tokens=48, ignore_eos=True))
        for _ in range(2):  # the prefill, then a run of rounds read back (the next one queued after it)
            engine.step()
        rounds_before = engine.requests[rid].spec_stats.rounds
        assert rounds_before >= 1, "the head drafted before it broke"
        # The head breaks: its extends' states, and so the chains drafted from them, come out NaN. The
        # run queued before (and the first round of the run after it) were drafted from a sound state.
        engine.proposer.head.fc.weight.data.fill_(float("nan"))
        req = engine.requests[rid]
        while req.draft_ready and not req.finished:
            engine.step()
        rounds_at_break = req.spec_stats.rounds
        assert not req.finished, "the request ended before its broken draft showed"
        assert rounds_at_break <= rounds_before + engine.spec_rounds + 1
        while engine.has_unfinished():
            engine.step()
        out = engine.requests.pop(rid)
    assert out.output == expected[0]
    assert out.spec_stats.rounds == rounds_at_break  # the broken rounds are no rounds; no drafting after them
