"""python -m drafter.train refuses what it can before the target loads — an --out that is the target's folder or
another model, flags out of range, capture layers an EAGLE-3 head cannot read, a missing or malformed data file —
refuses a --resume with other settings than the run's, says when filtering left nothing to train on, and an interrupt
saves the last whole step, from which --resume goes on."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from test_training_draft import TRAIN, VD, job, target, data  # noqa: F401 (fixtures)
from tandem.errors import ConfigError, TandemError
from tandem.training import pipeline
from tandem.training.cli import main_train_drafter


def _refused(argv: list[str], capsys, monkeypatch) -> str:
    """Run the command line with the target's load made to fail loudly: → its one-line error."""
    monkeypatch.setattr(pipeline, "make_engine", lambda job: pytest.fail("the target was loaded"))
    assert main_train_drafter(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("extra, message", [
    (["--ttt-steps", "0"], "--ttt-steps must be at least 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
    (["--max-steps", "0"], "--max-steps must be at least 1"),
    (["--draft-vocab-size", "0"], "--draft-vocab-size must be at least 2"),
    (["--capture-layers", "1,2"], "--capture-layers 1,2: an EAGLE-3 head reads three target layers, each in [0, 6)"),
    (["--capture-layers", "1,2,6"], "each in [0, 6)"),
    (["--reload-drafter", "notaport"], "--reload-drafter notaport: want HOST:PORT"),
    (["--reload-drafter", "127.0.0.1:1", "--internal-secret-file", "/nonexistent/secret"],
     "--internal-secret-file /nonexistent/secret: No such file or directory"),
    (["--lr", "-1"], "--lr must be a positive number, got -1.0"),
    (["--lr", "nan"], "--lr must be a positive number, got nan"),
    (["--epochs", "-3"], "--epochs must be a positive number, got -3.0"),
    (["--temperature", "-2"], "--temperature must be 0 (greedy) or more, got -2.0"),
    (["--eval-fraction", "5"], "--eval-fraction must be in [0, 1), got 5.0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be at least 0, got -1"),
    (["--draft-vocab-size", "100000"], "--draft-vocab-size 100000 exceeds the target's vocabulary of"),
    (["--eval-data", "/nonexistent/eval.jsonl"], "--eval-data /nonexistent/eval.jsonl: no such file"),
    (["--speculative-eagle-topk", "0"], "--speculative-eagle-topk must be >= 1, got 0"),
    (["--speculative-num-steps", "0"], "--speculative-num-steps must be >= 1, got 0"),
])
def test_bad_flags_are_refused_before_the_target_loads(target, data, tmp_path, capsys, monkeypatch, extra, message):  # noqa: F811
    err = _refused(["--target-model", str(target), "--data", str(data), "--out", str(tmp_path / "d"), *extra],
                   capsys, monkeypatch)
    assert message in err, err


def test_a_run_folder_that_cannot_be_made_is_refused_by_its_flag(target, data, tmp_path, capsys,  # noqa: F811
                                                                  monkeypatch):
    (tmp_path / "a-file").write_text("x")
    run = tmp_path / "a-file" / "run"
    err = _refused(["--target-model", str(target), "--data", str(data), "--out", str(tmp_path / "d"), "--run-dir",
                    str(run)], capsys, monkeypatch)
    assert f"--run-dir {run}: cannot create the run folder {run} (Not a directory)" in err, err


def test_out_is_never_the_target_or_another_model(target, data, tmp_path, capsys, monkeypatch):  # noqa: F811
    copy = tmp_path / "target"
    shutil.copytree(target, copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    for out in (copy, copy / "head"):
        err = _refused(["--target-model", str(copy), "--data", str(data), "--out", str(out)], capsys, monkeypatch)
        assert "is (or holds, or lies in) the target's folder" in err
    other = tmp_path / "other"
    shutil.copytree(target, other)
    err = _refused(["--target-model", str(target), "--data", str(data), "--out", str(other)], capsys, monkeypatch)
    assert "holds a model that is not an EAGLE-3 head: not overwritten" in err
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before


def test_out_that_is_a_file_a_foreign_head_or_unwritable_is_refused_before_loading(target, data, tmp_path, capsys,  # noqa: F811
                                                                                   monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    err = _refused(["--target-model", str(target), "--data", str(data), "--out", str(afile)], capsys, monkeypatch)
    assert f"--out {afile}: is a file, not a folder" in err
    foreign = tmp_path / "foreign"  # a head from elsewhere (a SpecForge export), copied in: no training.json
    from tandem.configs.model import ModelConfig
    from tandem.models.eagle3_checkpoint import write_random_eagle3

    write_random_eagle3(foreign, ModelConfig.from_dir(target), draft_vocab_size=VD)
    before = {p.name: p.read_bytes() for p in foreign.iterdir()}
    for resume in ([], ["--resume"]):
        err = _refused(["--target-model", str(target), "--data", str(data), "--out", str(foreign), *resume], capsys,
                       monkeypatch)
        assert "holds an EAGLE-3 head this trainer did not write: not overwritten" in err
    assert {p.name: p.read_bytes() for p in foreign.iterdir()} == before
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # (root writes anywhere: nothing to refuse)
            pytest.skip("this user can write a read-only folder")
        err = _refused(["--target-model", str(target), "--data", str(data), "--out", str(locked / "head")], capsys,
                       monkeypatch)
        assert f"{locked} is not writable" in err
    finally:
        locked.chmod(0o700)


def test_a_head_this_trainer_exported_is_its_own_without_training_json(target, data, tmp_path):  # noqa: F811
    """The export comes before the held-out evaluation and training.json: a run stopped between them left a head that
    a rerun refused as another's."""
    from tandem.training.cli import _check_out

    out = tmp_path / "draft"
    pipeline.run_job(job(target, data, out, max_steps=2))
    (out / "training.json").unlink()
    _check_out(str(out), out)  # (no refusal)


def test_data_is_read_whole_before_the_target_loads(target, tmp_path, capsys, monkeypatch):  # noqa: F811
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n" for _ in range(500)) + "{not json\n")
    err = _refused(["--target-model", str(target), "--data", str(bad), "--out", str(tmp_path / "d")], capsys, monkeypatch)
    assert "501" in err and str(bad) in err, err
    err = _refused(["--target-model", str(target), "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "d")],
                   capsys, monkeypatch)
    assert "none.jsonl: no such file" in err


@pytest.mark.parametrize("row, says", [(b"5", "a row is a JSON object, got int"),
                                       (b'{"messages": "hi"}', "a field of the wrong type"),
                                       (b'{"prompt_token_ids": [5], "response_token_ids": 7}', "a field of the wrong type"),
                                       (b'{"prompt_token_ids": ["a"]}', "a field of the wrong type"),
                                       (b'{"prompt_token_ids": [5, 99999]}',
                                        "prompt_token_ids holds 99999, outside the target's vocabulary [0, "),
                                       (b'{"prompt_token_ids": [5], "response_token_ids": [-3]}',
                                        "response_token_ids holds -3, outside the target's vocabulary [0, "),
                                       (b'{"prompt": "abc\xff"}', "not UTF-8 text (byte 16 of the line)")])
def test_a_malformed_row_is_one_line_naming_its_file_and_line(target, tmp_path, capsys, monkeypatch, row, says):  # noqa: F811
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt_token_ids": [5, 6, 7]}\n' + row + b"\n")
    err = _refused(["--target-model", str(target), "--data", str(bad), "--out", str(tmp_path / "d")], capsys, monkeypatch)
    assert f"error: {bad}:2: {says}" in err, err


def test_the_packages_own_demo_pair_is_never_an_output(target, data, capsys, monkeypatch):  # noqa: F811
    """The shipped head carries a training.json (which marks a head this trainer may replace): tandem up's default."""
    import tandem

    shipped = Path(tandem.__file__).resolve().parent / "demo_pair" / "draft"
    err = _refused(["--target-model", str(target), "--data", str(data), "--out", str(shipped)], capsys, monkeypatch)
    assert "lies inside the installed tandem package" in err, err


def test_tandem_train_drafter_says_its_refusals_in_one_line_too(target, data, tmp_path, capsys, monkeypatch):  # noqa: F811
    """`tandem train-drafter` is the same command as python -m drafter.train: a ValueError or OSError was a traceback."""
    from tandem import cli

    monkeypatch.setattr(pipeline, "run_job", lambda job, resume: (_ for _ in ()).throw(OSError("disk full")))
    assert cli.main(["train-drafter", "--target-model", str(target), "--data", str(data),
                     "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err == "error: disk full\n", err


def test_nothing_left_to_train_on_is_said_plainly(target, tmp_path):  # noqa: F811
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"prompt_token_ids": [7], "response_token_ids": []}) + "\n" for _ in range(4)))
    with pytest.raises(ConfigError, match="no sample to train on: each of the 4 has fewer than 3 tokens"):
        pipeline.run_job(dataclasses.replace(job(target, short, tmp_path / "d"), eval_fraction=0.0))


def test_resume_with_other_settings_is_refused_naming_them(target, data, tmp_path):  # noqa: F811
    out = tmp_path / "draft"
    pipeline.run_job(job(target, data, out, max_steps=2))
    with pytest.raises(ConfigError) as e:
        pipeline.run_job(dataclasses.replace(job(target, data, out, max_steps=4, ttt_steps=2), draft_vocab_size=VD + 8),
                         resume=True)
    assert f"draft_vocab_size {VD!r} → {VD + 8!r}" in str(e.value) and "ttt_steps 3 → 2" in str(e.value)
    # the course of training too: its batches and its learning-rate curve
    lr = TRAIN.optim.lr
    with pytest.raises(ConfigError) as e:
        pipeline.run_job(job(target, data, out, max_steps=4, batch_size=TRAIN.batch_size + 1,
                             optim=dataclasses.replace(TRAIN.optim, lr=lr / 2)), resume=True)
    assert (f"batch_size {TRAIN.batch_size} → {TRAIN.batch_size + 1}" in str(e.value)
            and f"optim.lr {lr!r} → {lr / 2!r}" in str(e.value))
    assert pipeline.run_job(job(target, data, out, max_steps=4), resume=True)["steps"] == 4  # the same: goes on


def test_an_interrupt_saves_the_step_under_way_once_whole_and_resume_goes_on(target, data, tmp_path, monkeypatch):  # noqa: F811
    """SIGINT in the middle of step 7 (after its optimizer step, where a GPU run waits on the host): the step ends, is
    saved as 8 done, and the run stops saying so; --resume trains steps 8..11, none twice."""
    import os
    import signal

    from tandem.training import eagle3_train

    out = tmp_path / "draft"
    one_step, calls, interrupt_at = eagle3_train._one_step, [], [7]

    def interrupted_in_7(*args, **kwargs):
        calls.append(args[5])  # the step
        result = one_step(*args, **kwargs)
        if args[5] in interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(eagle3_train, "_one_step", interrupted_in_7)
    before = signal.getsignal(signal.SIGINT)  # (SIG_IGN in a job a shell started in the background)
    with pytest.raises(TandemError, match=r"interrupted; the run folder .* holds step 8 of 12: --resume continues"):
        pipeline.run_job(job(target, data, out, max_steps=12, checkpoint_every=5))
    assert torch.load(out.with_name("draft.run") / "train_state.pt", weights_only=False)["step"] == 8
    assert signal.getsignal(signal.SIGINT) is before  # the loop's handler is gone
    calls.clear()
    interrupt_at.clear()
    assert pipeline.run_job(job(target, data, out, max_steps=12, checkpoint_every=5), resume=True)["steps"] == 12
    assert calls == [8, 9, 10, 11]


def test_a_gpu_asked_of_a_torch_that_sees_none_is_one_line():
    from tandem.args import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this torch sees a GPU")
    with pytest.raises(ConfigError, match=r"--device cuda: torch .* sees no GPU"):
        resolve_device("cuda")
    assert resolve_device("auto") == "cpu"


def test_specforge_spellings_are_the_same_settings():
    import argparse

    from tandem.training.cli import add_train_drafter

    parser = argparse.ArgumentParser()
    add_train_drafter(parser)
    theirs = parser.parse_args("--target-model-path T --train-data-path D --output-dir O --num-epochs 3 --learning-rate 1e-4 "
                               "--ttt-length 5 --save-interval 9 --tensor-parallel-size 2 --eval-data-path E".split())
    ours = parser.parse_args("--target-model T --data D --out O --epochs 3 --lr 1e-4 --ttt-steps 5 --checkpoint-every 9 "
                             "--tp-size 2 --eval-data E".split())
    assert vars(theirs) == vars(ours)


def test_responses_written_before_an_interrupt_are_not_generated_again(tmp_path):
    """complete_samples keeps each chunk's responses as it completes; a second run over the same prompts (a --resume)
    generates only the rest, and a cut last line or a line of another prompt is passed over."""
    from types import SimpleNamespace

    from tandem.sampling import SamplingParams
    from tandem.training.data import Sample, complete_samples

    class Engine:
        model_config = SimpleNamespace(max_position_embeddings=64)

        def __init__(self, stop_after: int | None = None):
            self.asked, self.stop_after = [], stop_after

        def generate(self, prompts, params, spec=None):
            if self.stop_after is not None and len(self.asked) >= self.stop_after:
                raise KeyboardInterrupt
            self.asked += [p[0] for p in prompts]
            return [SimpleNamespace(output_token_ids=[p[0] + 1, q.seed]) for p, q in zip(prompts, params)]

    samples = [Sample((10 * i + 1, 2)) for i in range(6)] + [Sample((99,), (5,))]
    params, kept = SamplingParams(max_new_tokens=4, seed=7), tmp_path / "responses.partial.jsonl"
    whole = complete_samples(Engine(), samples, params, chunk=2)
    with pytest.raises(KeyboardInterrupt):
        complete_samples(Engine(stop_after=4), samples, params, chunk=2, kept=kept)
    with open(kept, "a") as f:
        f.write('{"index": 5, "prompt_token_ids": [51, 2], "respo')  # cut mid-line
    again = Engine()
    assert complete_samples(again, samples, params, chunk=2, kept=kept) == whole
    assert again.asked == [41, 51]  # the first four were kept


def test_eval_only_takes_the_prompts_the_training_held_out(target, tmp_path, monkeypatch, capsys):  # noqa: F811
    from tandem.training import evaluate
    from tandem.training.data import Sample, save_samples

    draft = tmp_path / "draft"
    (tmp_path / "draft.run").mkdir()
    save_samples(tmp_path / "draft.run" / "eval_samples.jsonl", [Sample((5, 6, 7), (8,)), Sample((9, 10), (11,))])
    asked = []
    monkeypatch.setattr(evaluate, "evaluate_pair", lambda t, d, prompts, cfg: asked.append(prompts) or {})
    monkeypatch.setattr(evaluate, "format_report", lambda report: "")
    assert main_train_drafter(["--eval-only", "--target-model", str(target), "--draft-model", str(draft)]) == 0
    assert asked == [[[5, 6, 7], [9, 10]]]


def test_a_fresh_run_clears_the_run_folder_a_later_resume_reads(target, data, tmp_path, monkeypatch):  # noqa: F811
    """An earlier run's samples, vocabulary and checkpoint beside a new run's settings would be taken by a --resume
    of the new run (interrupted before it wrote its own): a fresh run removes them first."""
    out = tmp_path / "draft"
    pipeline.run_job(job(target, data, out, max_steps=3))
    run = out.with_name("draft.run")
    assert (run / "samples.jsonl").is_file() and (run / "train_state.pt").is_file()

    def interrupted(job):  # the fresh run is stopped while it loads the target
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "make_engine", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_job(job(target, data, out, max_steps=3, ttt_steps=2))
    assert not any((run / name).exists() for name in (*pipeline.RUN_FILES, "train_state.pt"))
    assert json.loads((run / "settings.json").read_text())["ttt_steps"] == 2


def test_a_fresh_run_refused_for_its_data_leaves_the_run_folder_as_it_was(target, data, tmp_path, capsys,  # noqa: F811
                                                                          monkeypatch):
    """A fresh run cleared the earlier run's files (and wrote its settings) before reading --data: a typo in the
    data's path or a bad row cost the earlier run's samples and checkpoint."""
    out = tmp_path / "draft"
    pipeline.run_job(job(target, data, out, max_steps=3))
    run = out.with_name("draft.run")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [5, 6]}\n{not json\n')
    monkeypatch.setattr(pipeline, "make_engine", lambda job: pytest.fail("the target was loaded"))
    with pytest.raises(ConfigError, match="bad.jsonl:2: not valid JSON"):
        pipeline.run_job(job(target, bad, out, max_steps=3, ttt_steps=2))
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
