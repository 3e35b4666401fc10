"""EAGLE-3 training on a tiny random target: the trainer lowers the draft loss, writes a checkpoint
that the drafter loads and that has exactly the tensors of docs/architecture.md's "Contracts", builds the
draft vocabulary from response frequencies, resumes from its saved step, and its dense TTT forward equals
the paged inference head — step 0 against draft-extend, steps k ≥ 1 against the drafter's own chain."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draft_checkpoints import design_tensor_shapes
from tandem.configs.model import ModelConfig
from tandem.models.random_checkpoint import LlamaShape, write_random_llama
from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
from tandem.speculative.spec_config import SpecConfig
from tandem.training.data import Sample
from tandem.training.eagle3_dense import DenseEagle3
from tandem.training.eagle3_train import Eagle3TrainConfig, draft_config_for, draft_metrics, export
from tandem.training.optim import OptimConfig
from tandem.training.pipeline import DrafterTrainJob, make_engine, run_job
from tandem.training.teacher import TargetTeacher
from tandem.training.vocab import build_draft_vocab

H, I, V, VD, Q, KV = 64, 128, 256, 96, 64, 32
SHAPE = LlamaShape(vocab_size=V, hidden_size=H, intermediate_size=I, num_layers=6, num_heads=4, num_kv_heads=2,
                   max_position_embeddings=128)
DESIGN_TENSORS = design_tensor_shapes(H, H, Q, KV, I, VD, V)
TRAIN = Eagle3TrainConfig(ttt_steps=3, batch_size=4, max_steps=30, checkpoint_every=10, compile=False,
                          optim=OptimConfig(lr=3e-3, warmup_steps=5, grad_clip=0.5), precision="fp32")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    # std 0.08: a random target with decisive, non-uniform distributions (something to learn)
    return write_random_llama(tmp_path_factory.mktemp("target"), SHAPE, std=0.08, seed=3, bos=1, eos=None)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt_token_ids": torch.randint(3, V, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()}) + "\n")
    return path


def job(target: Path, data: Path, out: Path, **train) -> DrafterTrainJob:
    return DrafterTrainJob(target_model=str(target), out=str(out), data=str(data), max_new_tokens=24, draft_vocab_size=VD,
                           eval_fraction=0.1, train=dataclasses.replace(TRAIN, **train), eval=None)


@pytest.fixture(scope="module")
def trained(target, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "draft"
    summary = run_job(job(target, data, out))
    return out, summary


def test_training_lowers_the_draft_loss(target, trained):
    out, summary = trained
    run = out.with_name(out.name + ".run")
    j = job(target, Path("unused"), out)
    engine = make_engine(j)
    try:
        from tandem.training.data import load_samples
        from tandem.training.eagle3_train import build_head
        from tandem.training.vocab import vocab_from_tensors

        samples = load_samples(run / "samples.jsonl")
        blob = torch.load(run / "vocab.pt", weights_only=True)
        vocab = vocab_from_tensors(blob["d2t"], blob["t2d"])
        teacher = TargetTeacher(engine)
        cfg = draft_config_for(engine.model_config, teacher.capture_layers, VD)
        fresh = build_head(str(target), cfg, vocab, TRAIN, 128 + TRAIN.ttt_steps)
        before = draft_metrics(fresh, teacher, samples, vocab, TRAIN)
    finally:
        engine.shutdown()
    after = summary["heldout"]  # same metric on the held-out samples, after 30 steps
    # The soft loss cannot fall below the target's entropy, so compare the drop and the accuracy.
    assert summary["train_ema"]["loss"] < before["loss_weighted"] - 0.5
    assert after["loss_weighted"] < before["loss_weighted"] - 0.5
    assert after["acc_by_step"][0] > before["acc_by_step"][0] + 0.2


def test_checkpoint_has_the_design_tensors_and_loads_in_the_drafter(target, trained):
    out, _ = trained
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert shapes == DESIGN_TENSORS  # exactly: no embed_tokens, no model. prefix, nothing extra
    raw = json.loads((out / "config.json").read_text())
    capture = ModelConfig.from_dir(target).default_capture_layers()  # [2, 3, 3] on six layers
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["num_hidden_layers"] == 1
    assert raw["draft_vocab_size"] == VD and raw["vocab_size"] == V
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [c - 1 for c in capture]
    drafter = Eagle3Drafter.from_dirs(str(out), str(target))  # validates against the target first
    assert drafter.capture_layers == capture


def test_vocab_mapping_is_consistent_and_built_from_frequencies(trained):
    out, _ = trained
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    target_ids = torch.arange(VD) + d2t
    assert bool(t2d[target_ids].all()) and int(t2d.sum()) == VD
    assert torch.equal(t2d.nonzero().flatten(), target_ids)  # SpecForge's consistency check
    from tandem.training.data import load_samples

    samples = load_samples(out.with_name(out.name + ".run") / "samples.jsonl")
    counts = torch.bincount(torch.tensor([t for s in samples for t in s.response]), minlength=V)
    top = counts.argsort(descending=True, stable=True)[:20]
    assert bool(t2d[top].all())  # the most frequent response tokens are in the draft vocabulary


def test_build_draft_vocab_ranks_and_pads():
    vocab = build_draft_vocab([[5, 5, 5, 9, 9, 7]], target_vocab=12, draft_vocab=5)
    assert vocab.used.tolist() == [0, 1, 5, 7, 9]  # 5, 9, 7 by frequency, then the lowest unused ids
    assert vocab.target_to_draft()[9].item() == 4 and vocab.target_to_draft()[2].item() == -1


def test_resume_continues_from_the_saved_step(target, data, tmp_path, capsys):
    out = tmp_path / "draft"
    run_job(job(target, data, out, max_steps=10, checkpoint_every=5))
    blob = torch.load(out.with_name("draft.run") / "train_state.pt", weights_only=False)
    assert blob["step"] == 10
    capsys.readouterr()
    summary = run_job(job(target, data, out, max_steps=15, checkpoint_every=5), resume=True)
    err = capsys.readouterr().err
    assert "resumed EAGLE-3 training at step 10 of 15" in err and "reusing the completed samples" in err
    assert torch.load(out.with_name("draft.run") / "train_state.pt", weights_only=False)["step"] == 15
    assert summary["steps"] == 15


@pytest.fixture(scope="module")
def random_head(target, tmp_path_factory):
    """A DenseEagle3 with random weights (norms too) and a random draft vocabulary, exported."""
    cfg = draft_config_for(ModelConfig.from_dir(target), (1, 3, 4), VD)
    from safetensors.torch import load_file

    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    head = DenseEagle3(cfg, embed, 160)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
    used = torch.randperm(V, generator=g)[:VD].sort().values
    head.set_vocab(used - torch.arange(VD), torch.zeros(V, dtype=torch.bool).index_fill_(0, used, True))
    out = export(head, cfg, tmp_path_factory.mktemp("random_head") / "draft")
    return head.eval(), out


def test_dense_step0_equals_the_paged_extend(target, random_head):
    head, out = random_head
    drafter = Eagle3Drafter.from_dirs(str(out), str(target), DrafterConfig(page_size=4, kv_pages=64, page_shuffle_seed=3))
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, V, (2, 23), generator=g)
    feats = torch.randn(2, 23, 3 * H, generator=g)
    with torch.no_grad():
        dense = head.ttt(tokens, feats, steps=1)[0]  # [2, 22, VD]
    paged = drafter.extend([(f"r{b}", tokens[b, 1:].tolist(), feats[b, :-1]) for b in range(2)], return_logits=True)
    for b in range(2):
        assert torch.allclose(dense[b], paged[b][1], atol=1e-4), (dense[b] - paged[b][1]).abs().max()


def test_dense_ttt_steps_equal_the_drafters_chain(target, random_head):
    """TTT step k at the last prompt row, fed the chain's own tokens, gives the drafter's depth-k+1
    scores: training at step k is exactly what the drafter computes at that depth."""
    head, out = random_head
    drafter = Eagle3Drafter.from_dirs(str(out), str(target), DrafterConfig(page_size=4, kv_pages=64))
    g = torch.Generator().manual_seed(4)
    m, steps = 13, 4
    prompt = torch.randint(0, V, (m + 1,), generator=g).tolist()  # x_0..x_m
    feats = torch.randn(m, 3 * H, generator=g)  # f_0..f_{m-1}
    drafter.extend([("a", prompt[1:], feats)])
    tree = drafter.draft(["a"], SpecConfig(steps, 1, steps + 1))[0]
    chain = tree.tokens[1:]
    tokens = torch.tensor([prompt + chain[:-1]])  # the chain's tokens are the next steps' inputs
    padded = torch.cat([feats, torch.zeros(len(chain) - 1, 3 * H)]).unsqueeze(0)  # rows past m-1 unused
    with torch.no_grad():
        logits = head.ttt(tokens, padded, steps)
    to_target = torch.arange(VD) + head.d2t
    for k in range(steps):
        logp = logits[k][0, m - 1].log_softmax(-1)
        assert int(to_target[logp.argmax()]) == chain[k]
        step_score = tree.scores[k + 1] - tree.scores[k]
        assert float(logp.max()) == pytest.approx(step_score, abs=1e-4)


def test_cli_trains_exports_and_evaluates(target, data, tmp_path, capsys):
    from tandem.training.cli import main_train_drafter

    out = tmp_path / "cli_draft"
    common = ["--target-model", str(target), "--eval-max-new-tokens", "8", "--max-eval-prompts", "4", "--json"]
    rc = main_train_drafter(["--data", str(data), "--out", str(out), "--max-new-tokens", "16", "--max-steps", "3",
                             "--ttt-steps", "2", "--draft-vocab-size", str(VD), "--eval-fraction", "0.1", "--no-compile", *common])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    t0 = summary["eval"]["by_temperature"]["0"]
    assert t0["rounds"] > 0 and 1.0 <= t0["accept_length_mean"] <= 6.0
    assert set(summary["eval"]["by_temperature"]) == {"0", "1"} and summary["eval"]["speed_plain"]["tokens"] > 0
    assert (out / "training.json").is_file()
    rc = main_train_drafter(["--eval-only", "--draft-model", str(out), "--data", str(data), *common])
    assert rc == 0 and json.loads(capsys.readouterr().out)["prompts"] == 4
    assert main_train_drafter(["--target-model", str(target), "--out", str(out)]) == 2  # no --data: one-line error
    assert "--data or --traffic is required" in capsys.readouterr().err


def test_jsonl_rows_prompts_conversations_and_completed_samples(tmp_path):
    from tandem.chat_template import ChatTemplate
    from tandem.training.stdlib_text import train_tokenizer
    from tandem.errors import ConfigError
    from tandem.tokenizer import TextTokenizer
    from tandem.training.data import read_jsonl

    train_tokenizer(tmp_path, vocab_size=300)  # a tokenizer folder with the demo's chat template
    tok, chat = TextTokenizer(tmp_path), ChatTemplate.from_model_dir(tmp_path)
    rows = [
        {"prompt": "def f():"},
        {"prompt_token_ids": [5, 6, 7]},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"prompt": "x = ", "response": "1"},
        {"prompt_token_ids": [9], "response_token_ids": [10, 11]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    samples = read_jsonl(path, str(tmp_path))
    assert samples[0] == Sample(tuple(tok.encode("def f():")))
    assert samples[1] == Sample((5, 6, 7))
    rendered = tok.encode(chat.render([{"role": "user", "content": "hi"}], add_generation_prompt=True))
    # the final assistant turn as the demo template writes it: "hello<|eos|>\n", its end-of-turn token included
    answer = tuple(tok.encode("hello<|eos|>\n"))
    assert tok.token_id("<|eos|>") in answer
    assert samples[2] == Sample(tuple(rendered)) and samples[3] == Sample(tuple(rendered), answer)
    assert samples[6] == samples[3]  # ShareGPT's spelling of the same conversation
    assert samples[4] == Sample(tuple(tok.encode("x = ")), tuple(tok.encode("1")))
    assert samples[5] == Sample((9,), (10, 11))
    assert all(s.response is None for s in read_jsonl(path, str(tmp_path), regenerate=True))
    path.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ConfigError, match="data.jsonl:2: a row needs"):
        read_jsonl(path, str(tmp_path))


@pytest.mark.slow
def test_teacher_under_tensor_parallelism_gives_the_tp1_features(target):
    """The teacher goes through the engine's executor, so --tp-size 2 yields the same features and
    logits (rank 0 gathers the logits; the residual stream is replicated)."""
    seqs = [[5, 9, 17, 33, 2, 8, 101], [7, 7, 200, 31]]
    results = {}
    for tp in (1, 2):
        engine = make_engine(DrafterTrainJob(target_model=str(target), out="unused", tp_size=tp))
        try:
            results[tp] = TargetTeacher(engine).forward(seqs)
        finally:
            engine.shutdown()
    for (f1, l1), (f2, l2) in zip(results[1], results[2]):
        assert torch.allclose(f1, f2, atol=1e-4) and torch.allclose(l1, l2, atol=1e-4)


def test_demo_pair_cli_wants_a_folder_for_another_head(capsys):
    from tandem.cli import main

    assert main(["demo-models", "--head-data-temperature", "1.0"]) == 2
    assert "--head-data-temperature needs --out" in capsys.readouterr().err
