"""Capture of served traffic for drafter training (``--capture-traffic``), over real sockets.

The verifier (with its drafter, so tokens arrive through prefill, plain steps and verified trees)
writes every finished request; the test checks the dataset against independent references: the
tokens the client received, and the EAGLE-3 features of one whole-sequence target forward over the
same tokens. Then a head is trained from the dataset alone and loads in the drafter.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from services import generate, prompts_of, read_metrics, start_pair, wait_for
from tandem.rpc.verifier.v1 import verifier_pb2 as pb
from tandem.rpc.verifier.v1 import verifier_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Serve a few requests with capture on; → (pair folder, traffic folder, {tuple(tokens): prompt length},
    the cancelled request's prompt + the tokens its client received)."""
    from draft_checkpoints import write_pair

    root = tmp_path_factory.mktemp("traffic")
    write_pair(root)
    traffic = root / "captured"
    drafter, verifier = start_pair(root, tmp_path_factory.mktemp("logs"), verifier_args=("--capture-traffic", str(traffic)))
    served = {}
    try:
        for i, prompt in enumerate(prompts_of(8)):
            sampling = {"temperature": 1.0, "seed": i} if i % 3 == 2 else {}
            tokens, _ = generate(verifier.address, prompt, max_new_tokens=20 + 3 * i, **sampling)
            served[tuple(prompt + tokens)] = len(prompt)
        with grpc.insecure_channel(verifier.address) as channel:  # cancelled after its first tokens (a stop string)
            stream = pb_grpc.VerifierStub(channel).Generate(pb.GenerateRequest(
                prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_new_tokens=400, ignore_eos=True)))
            cancelled = [5, 6, 7] + list(next(stream).token_ids)
            stream.cancel()
        wait_for(lambda: read_metrics(verifier.metrics_port).get('tandem:request_success_total{finished_reason="abort"}')
                 == 1.0, 30, "the verifier to abort the cancelled request")
    finally:
        assert verifier.stop() == 0  # SIGTERM flushes the last shard
        drafter.stop()
    return root, traffic, served, cancelled


def test_dataset_holds_every_finished_request_and_nothing_else(captured):
    from tandem.traffic.dataset import TrafficManifest, read_index

    root, traffic, served, cancelled = captured
    index = read_index(traffic)
    finished = [(tokens, plen) for _, tokens, plen, info in index if info["finish_reason"] != "abort"]
    assert {tuple(tokens): plen for tokens, plen in finished} == served and len(finished) == len(served)
    # The cancelled request keeps what the target wrote until the cancel: at least what the client saw.
    aborted = [(tokens, plen) for _, tokens, plen, info in index if info["finish_reason"] == "abort"]
    assert len(aborted) == 1 and aborted[0][1] == 3
    assert aborted[0][0][: len(cancelled)] == cancelled and len(aborted[0][0]) < 3 + 400
    manifest = TrafficManifest.read(traffic)
    assert manifest.capture_layers == (1, 3, 4)  # the draft's aux layers (0, 2, 3) as layer inputs
    assert manifest.feature_width == 3 * 64
    assert {info["temperature"] for _, _, _, info in index} == {0.0, 1.0}


def test_stored_features_equal_a_whole_sequence_forward(captured):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.traffic.dataset import read_features, read_index
    from tandem.training.teacher import TargetTeacher

    root, traffic, _, _ = captured
    index = read_index(traffic)
    with LLMEngine(EngineConfig(model=str(root / "target"), capture_layers=(1, 3, 4))) as engine:
        reference = TargetTeacher(engine).forward([tokens for _, tokens, _, _ in index])
    for (ref, tokens, _, _), (feats, _) in zip(index, reference):
        stored = read_features(ref)
        assert stored.shape == (len(tokens) - 1, 3 * 64)
        torch.testing.assert_close(stored, feats[: len(tokens) - 1], atol=2e-5, rtol=1e-4)


def test_traffic_targets_align_with_the_teacher(captured):
    """For greedy samples the stored next tokens are the teacher's argmax at every learned position."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.traffic.dataset import read_index
    from tandem.training.data import read_traffic
    from tandem.training.teacher import TargetTeacher
    from tandem.training.ttt_batch import make_batch
    from tandem.training.vocab import build_draft_vocab

    root, traffic, _, _ = captured
    samples = read_traffic([str(traffic)])
    vocab = build_draft_vocab([s.tokens for s in samples], 256, 256)  # the whole vocabulary: nothing masked
    with LLMEngine(EngineConfig(model=str(root / "target"), capture_layers=(1, 3, 4))) as engine:
        teacher = TargetTeacher(engine)
        stored = make_batch(samples, teacher.teach(samples), vocab.used, vocab.target_to_draft(), 3, False, "cpu")
        online = teacher.forward([s.tokens for s in samples])
    online_batch = make_batch(samples, online, vocab.used, vocab.target_to_draft(), 3, False, "cpu")
    temperatures = [info["temperature"] for _, _, _, info in read_index(traffic)]  # same order as read_traffic
    for b, (s, temperature) in enumerate(zip(samples, temperatures)):
        n = len(s.tokens)
        torch.testing.assert_close(stored.features[b, : n - 1], online_batch.features[b, : n - 1], atol=2e-5, rtol=1e-4)
        rows = stored.mask[b]
        # Learned: positions len(prompt)-1 .. n-2 (predicting each response token); n-1 has no next token.
        assert rows.nonzero().flatten().tolist() == list(range(len(s.prompt) - 1, n - 1))
        if temperature == 0.0:  # greedy: the stored next token is the teacher's argmax
            assert torch.equal(stored.target_id[b][rows], online_batch.target_id[b][rows])
        else:  # a draw from the target's distribution: the stored token, whatever the argmax
            assert torch.equal(stored.target_id[b][rows], vocab.target_to_draft()[torch.tensor(s.response)])


def test_a_head_trained_on_traffic_alone_loads_in_the_drafter(captured, tmp_path):
    from tandem.speculative.drafter import Eagle3Drafter
    from tandem.training.eagle3_train import Eagle3TrainConfig
    from tandem.training.pipeline import DrafterTrainJob, run_job

    root, traffic, served, _ = captured
    job = DrafterTrainJob(target_model=str(root / "target"), out=str(tmp_path / "head"), traffic=(str(traffic),),
                          eval_fraction=0.25, draft_vocab_size=128, eval=None,
                          train=Eagle3TrainConfig(max_steps=8, batch_size=2, ttt_steps=3, compile=False))
    summary = run_job(job)
    assert summary["train_samples"] + 2 == len(served) + 1  # the 9 samples (8 finished, 1 cancelled), 2 held out
    assert all(torch.isfinite(torch.tensor(summary["heldout"]["loss_by_step"])))
    drafter = Eagle3Drafter.from_dirs(str(tmp_path / "head"), str(root / "target"))
    assert drafter.capture_layers == (1, 3, 4)
