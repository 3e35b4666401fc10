"""The demo target's trainer: the folder it writes loads in transformers and in our engine with the
same logits as the training model, and a resumed run ends with the weights of an uninterrupted one.
Tiny demo-shaped models only (the real demo run takes minutes)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.errors import ConfigError
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling import SamplingParams
from tandem.training.corpus import CorpusConfig
from tandem.training.dense_llama import DenseLlama, LlamaDims, save_hf_folder
from tandem.training.lm import LMTrainConfig, train_lm
from tandem.training.optim import OptimConfig

TINY = LlamaDims(vocab_size=2048, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4, num_kv_heads=2,
                 context=64)
CFG = LMTrainConfig(dims=TINY, steps=4, batch_size=2, corpus=CorpusConfig(limit_bytes=200_000), compile=False,
                    precision="fp32", eval_every=2, eval_windows=4, checkpoint_every=2,
                    optim=OptimConfig(lr=3e-3, warmup_steps=4))  # warm-up covers the split: same lr both ways


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_saved_model_loads_in_transformers_and_our_engine_with_equal_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model = DenseLlama(TINY)
    model.init_weights(seed=5)
    with torch.no_grad():  # wider than the init, so logits differ clearly between tokens
        for name, p in model.named_parameters():
            p.mul_(4.0) if p.dim() == 2 else p.add_(0.1 * torch.randn(p.shape))
    folder = save_hf_folder(model, tmp_path / "lm", bos=0, eos=1)
    prompt = torch.randint(3, TINY.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours_train = model(prompt)[0]
        hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        theirs = hf(prompt).logits[0]
    with LLMEngine(EngineConfig(model=str(folder), kv_pages=32)) as engine:
        served = engine.prompt_logits(prompt[0].tolist())
    scale = theirs.abs().max()
    assert float((ours_train - theirs).abs().max() / scale) < 1e-4
    assert float((served - theirs).abs().max() / scale) < 1e-4
    assert theirs.std(-1).mean() > 0.5  # the comparison is not between near-constant logits


def test_train_writes_a_servable_folder_and_resume_matches_an_uninterrupted_run(tmp_path, capsys):
    whole = train_lm(CFG, tmp_path / "whole")
    train_lm(dataclasses.replace(CFG, steps=2), tmp_path / "split")
    capsys.readouterr()
    resumed = train_lm(CFG, tmp_path / "split", resume=True)
    assert "resumed from step 2" in capsys.readouterr().err
    assert resumed["steps"] == whole["steps"] == 4
    with pytest.raises(ConfigError, match=f"batch_size {CFG.batch_size} → {CFG.batch_size + 1}"):
        train_lm(dataclasses.replace(CFG, steps=6, batch_size=CFG.batch_size + 1), tmp_path / "split", resume=True)
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(str(tmp_path / "split" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6), name
    folder = tmp_path / "whole"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "training.json"):
        assert (folder / name).is_file(), name
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["max_position_embeddings"] == TINY.context
    with LLMEngine(EngineConfig(model=str(folder), kv_pages=32)) as engine:
        out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 5


def test_out_that_this_trainer_did_not_write_is_refused_and_left_alone(tmp_path, capsys):
    """--out is replaced by the trained model: a folder of anything else was deleted whole (user sweep)."""
    from tandem.training.lm import main

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("precious")
    (tmp_path / "afile").write_text("x")
    for out, says in ((victim, "holds files this trainer did not write"), (tmp_path / "afile", "is a file")):
        assert main(["--out", str(out), "--steps", "1", "--no-compile"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --out {out}: {says}") and "\n" not in err, err
    assert (victim / "notes.txt").read_text() == "precious" and (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("flags, says", [(["--steps", "0"], "--steps and --batch-size must be at least 1"),
                                         (["--batch-size", "-1"], "--steps and --batch-size must be at least 1"),
                                         (["--lr", "-1"], "--lr must be a positive number"),
                                         (["--lr", "nan"], "--lr must be a positive number")])
def test_settings_that_cannot_train_are_one_line_before_any_work(tmp_path, capsys, flags, says):
    from tandem.training.lm import main

    assert main(["--out", str(tmp_path / "m"), "--no-compile", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {says}") and "\n" not in err, err
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.run").exists()


def test_the_shipped_demo_target_is_never_an_output():
    """The shipped target carries the training.json of a run of this trainer, which would let a run replace it."""
    from pathlib import Path

    import tandem
    from tandem.errors import ConfigError
    from tandem.training.lm import check_out_dir

    shipped = Path(tandem.__file__).resolve().parent / "demo_pair" / "target"
    assert (shipped / "training.json").is_file()
    with pytest.raises(ConfigError, match="inside the installed tandem package"):
        check_out_dir(shipped)


def test_a_fresh_run_clears_an_earlier_runs_checkpoint_so_a_resume_cannot_take_it(tmp_path, monkeypatch):
    from tandem.training import lm
    from tandem.training.state import STATE_FILE

    train_lm(dataclasses.replace(CFG, steps=2), tmp_path / "m")
    run = tmp_path / "m.run"
    assert (run / STATE_FILE).is_file()

    def stopped(*args, **kwargs):
        raise RuntimeError("stopped before its first checkpoint")

    monkeypatch.setattr(lm, "make_optimizer", stopped)
    with pytest.raises(RuntimeError, match="stopped"):
        train_lm(dataclasses.replace(CFG, steps=2, batch_size=CFG.batch_size + 1), tmp_path / "m")
    assert not (run / STATE_FILE).exists()  # (a --resume with these settings would have loaded the other run's state)
