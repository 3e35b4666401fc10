"""The whole drafter-training job: data → target responses → draft vocabulary → TTT training →
SGLang-format export → held-out metrics and speculative evaluation.

Everything a resumed run needs is kept in the run folder: the completed samples
(``samples.jsonl``, ``eval_samples.jsonl`` — generating them is the slow part on a CPU; until they are complete, the
responses written so far, chunk by chunk), the settings that shape the head (``settings.json``), the
vocabulary (``vocab.pt``) and the trainer's checkpoint. ``--resume`` reuses what it finds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.errors import ConfigError
from tandem.training.data import (Sample, complete_samples, fit_context, load_samples, read_jsonl, read_traffic,
                                  save_samples)
from tandem.training.eagle3_train import Eagle3TrainConfig, draft_metrics, train_eagle3
from tandem.training.evaluate import EvalConfig, evaluate_pair, format_report
from tandem.training.progress import note
from tandem.training.state import STATE_FILE, flat_settings, resumed_settings_check, write_settings
from tandem.training.vocab import DraftVocab, build_draft_vocab, vocab_from_tensors


# What a run folder keeps (besides the trainer's checkpoint, tandem.training.state)
SAMPLES, EVAL_SAMPLES, VOCAB = "samples.jsonl", "eval_samples.jsonl", "vocab.pt"
PARTIAL = {SAMPLES: "responses.partial.jsonl", EVAL_SAMPLES: "eval_responses.partial.jsonl"}  # until they are complete
RUN_FILES = (SAMPLES, EVAL_SAMPLES, *PARTIAL.values(), VOCAB)


@dataclass(frozen=True)
class DrafterTrainJob:
    target_model: str
    out: str  # the draft folder to write
    data: str | None = None  # JSONL (see tandem.training.data); or pass samples to run_job
    traffic: tuple[str, ...] = ()  # folders of captured served traffic (features stored: no target forward)
    run_dir: str | None = None  # default: OUT.run
    max_new_tokens: int = 256  # response length when the target writes it
    temperature: float = 0.0  # of the target's responses (0: greedy)
    regenerate: bool = False  # ignore responses given in the data
    max_samples: int | None = None
    eval_data: str | None = None  # held-out JSONL; default: a slice of --data
    eval_fraction: float = 0.05
    max_eval_prompts: int = 64
    draft_vocab_size: int | None = None  # default: min(32000, target vocab)
    capture_layers: tuple[int, ...] | None = None  # default: the target's [2, N//2, N-3]
    tp_size: int = 1
    device: str = "cpu"
    seed: int = 0
    train: Eagle3TrainConfig = field(default_factory=Eagle3TrainConfig)
    eval: EvalConfig | None = field(default_factory=EvalConfig)  # None: no speculative evaluation

    @property
    def run_path(self) -> Path:
        return run_folder(self.out, self.run_dir)


def run_folder(out: str, run_dir: str | None = None) -> Path:
    """Where the run that writes the head ``out`` keeps its samples, vocabulary and checkpoint: ``run_dir``, else OUT.run."""
    return Path(run_dir) if run_dir else Path(out).with_name(Path(out).name + ".run")


def make_engine(job: DrafterTrainJob):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.training.evaluate import KV_PAGES

    return LLMEngine(EngineConfig(model=job.target_model, device=job.device, tp_size=job.tp_size,
                                  capture_layers=job.capture_layers, seed=job.seed, kv_pages=KV_PAGES))


def split_eval(samples: list[Sample], job: DrafterTrainJob) -> tuple[list[Sample], list[Sample]]:
    """Hold out a seeded random slice of the data (at most max_eval_prompts samples)."""
    if len(samples) < 2 or job.eval_fraction <= 0:
        return samples, []
    count = min(job.max_eval_prompts, max(1, int(len(samples) * job.eval_fraction)))
    held = set(random.Random(job.seed).sample(range(len(samples)), count))
    return [s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held]


def _reusing(job: DrafterTrainJob, resume: bool) -> bool:
    """Whether a resumed run takes its completed samples from the run folder."""
    return resume and (job.run_path / SAMPLES).is_file()


def read_data(job: DrafterTrainJob, samples: list[Sample] | None, eval_samples: list[Sample] | None,
              resume: bool) -> tuple[list[Sample] | None, list[Sample] | None]:
    """The rows of --data, --traffic and --eval-data, read (every line checked) before the target loads: a bad line
    at the end of a large file is not found after minutes of loading. (None, None) where a resumed run reuses its
    completed samples."""
    if _reusing(job, resume):
        return None, None
    if samples is None:
        if job.data is None and not job.traffic:
            raise ValueError("no training data: pass --data JSONL or --traffic DIR")
        samples = read_jsonl(job.data, job.target_model, job.regenerate, job.max_samples) if job.data else []
        samples = (samples + read_traffic(list(job.traffic)))[: job.max_samples]
    if eval_samples is None:
        if job.eval_data is not None:
            eval_samples = read_jsonl(job.eval_data, job.target_model, job.regenerate, job.max_eval_prompts)
        else:
            samples, eval_samples = split_eval(samples, job)
            # Held out from served traffic: measured like any held-out sample, against the target's own
            # greedy response and distribution (a served response may have been sampled at any temperature).
            eval_samples = [Sample(s.prompt) if s.traffic is not None else s for s in eval_samples]
    return samples, eval_samples


def prepare_samples(engine, job: DrafterTrainJob, samples: list[Sample] | None, eval_samples: list[Sample] | None,
                    resume: bool) -> tuple[list[Sample], list[Sample]]:
    """``samples`` and ``eval_samples`` (read_data's) with the target's responses, saved in the run folder; or a resumed
    run's, from there."""
    from tandem.sampling import SamplingParams

    run = job.run_path
    train_file, eval_file = run / SAMPLES, run / EVAL_SAMPLES
    if _reusing(job, resume):
        note(f"reusing the completed samples in {run} (those of the run that wrote them: --data and --traffic given "
             "now are not read; a new run folder trains on them)")
        return load_samples(train_file), (load_samples(eval_file) if eval_file.is_file() else [])
    context = engine.model_config.max_position_embeddings
    samples = [fit_context(s, context) for s in samples]
    eval_samples = [fit_context(s, context) for s in eval_samples]
    params = SamplingParams(temperature=job.temperature, max_new_tokens=job.max_new_tokens, seed=job.seed)
    missing = sum(s.response is None for s in samples)
    if missing or eval_samples:  # (complete_samples says which an interrupted run had kept)
        note(f"{missing} of {len(samples)} samples need a response (+{len(eval_samples)} held out): the target writes "
             f"them, up to {job.max_new_tokens} tokens, temperature {job.temperature:g}")
    # Each chunk's responses are kept in the run folder as they come, for a --resume after an interrupt (a fresh
    # run's start_run_folder cleared the folder).
    run.mkdir(parents=True, exist_ok=True)
    partial = {name: run / kept for name, kept in PARTIAL.items()}
    samples = complete_samples(engine, samples, params, kept=partial[SAMPLES])
    # Held-out responses the target writes here are greedy: they measure the draft loss on the target's
    # own argmax path (held-out served traffic keeps the responses it was served with).
    eval_samples = complete_samples(engine, eval_samples, dataclasses.replace(params, temperature=0.0),
                                    kept=partial[EVAL_SAMPLES])
    kept = [s for s in samples if len(s.tokens) >= 3]  # a sample needs a row to train on
    if not kept:
        raise ConfigError(f"no sample to train on: each of the {len(samples)} has fewer than 3 tokens (prompt and "
                          "response together); give longer prompts, or a larger --max-new-tokens")
    samples = kept
    save_samples(train_file, samples)
    save_samples(eval_file, eval_samples)
    for path in partial.values():  # (the completed samples hold them now)
        path.unlink(missing_ok=True)
    return samples, eval_samples


def prepare_vocab(job: DrafterTrainJob, samples: list[Sample], target_vocab: int, resume: bool) -> DraftVocab:
    path = job.run_path / VOCAB
    if resume and path.is_file():
        blob = torch.load(path, weights_only=True)
        return vocab_from_tensors(blob["d2t"], blob["t2d"])
    size = _draft_vocab_size(job, target_vocab)
    # Frequencies of the tokens the head learns to predict: the responses (and the prompts when
    # their positions are trained too).
    counted = [s.tokens if job.train.include_prompt_loss else list(s.response or ()) for s in samples]
    vocab = build_draft_vocab(counted, target_vocab, size)
    torch.save({"d2t": vocab.d2t, "t2d": vocab.t2d}, path)
    return vocab


def with_traffic_layers(job: DrafterTrainJob) -> DrafterTrainJob:
    """Captured traffic fixes the target layers the head reads: the ones the verifier captured."""
    from tandem.configs.model import ModelConfig
    from tandem.traffic.dataset import TrafficManifest

    layers = job.capture_layers
    target = ModelConfig.from_dir(job.target_model)
    for folder in job.traffic:
        m = TrafficManifest.read(Path(folder))
        if (m.hidden_size, m.vocab_size) != (target.hidden_size, target.vocab_size):
            raise ConfigError(f"{folder} was captured from a target with hidden size {m.hidden_size} and vocabulary "
                              f"{m.vocab_size}; {job.target_model} has {target.hidden_size} and {target.vocab_size}")
        if layers is not None and tuple(layers) != m.capture_layers:
            raise ConfigError(f"{folder} holds features of target layers {list(m.capture_layers)}, not "
                              f"{list(layers)}; train on one set of layers")
        layers = m.capture_layers
    return dataclasses.replace(job, capture_layers=layers)


def run_job(job: DrafterTrainJob, samples: list[Sample] | None = None, eval_samples: list[Sample] | None = None,
            resume: bool = False) -> dict:
    """Train, export to ``job.out``, evaluate; returns the summary also written to OUT/training.json."""
    from tandem.training.teacher import TargetTeacher

    if job.traffic:
        job = with_traffic_layers(job)
    settings = check_settings(job, resume)
    samples, eval_samples = read_data(job, samples, eval_samples, resume)
    start_run_folder(job, resume, settings)  # (after the data is read: a run refused for its data changes nothing)
    torch.manual_seed(job.seed)
    engine = make_engine(job)
    try:
        samples, eval_samples = prepare_samples(engine, job, samples, eval_samples, resume)
        vocab = prepare_vocab(job, samples, engine.model_config.vocab_size, resume)
        teacher = TargetTeacher(engine)
        train_cfg = dataclasses.replace(job.train, device=job.device, seed=job.seed)
        head, summary = train_eagle3(teacher, job.target_model, samples, vocab, train_cfg, job.out, job.run_path, resume)
        summary["train_samples"] = len(samples)
        summary["train_tokens"] = sum(len(s.tokens) for s in samples)
        if eval_samples:
            summary["heldout"] = heldout_metrics(head, teacher, eval_samples, vocab, train_cfg)
    finally:
        engine.shutdown()
    if job.eval is not None and eval_samples:
        eval_cfg = dataclasses.replace(job.eval, device=job.device, tp_size=job.tp_size, seed=job.seed)
        summary["eval"] = evaluate_pair(job.target_model, job.out, [list(s.prompt) for s in eval_samples], eval_cfg)
        note(format_report(summary["eval"]))
    (Path(job.out) / "training.json").write_text(json.dumps(_without_nan(summary), indent=2, default=str) + "\n")
    return summary


def _without_nan(value):
    """``value`` with every NaN or infinity as None: training.json stays JSON (strict parsers refuse NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _without_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_nan(v) for v in value]
    return value


def check_settings(job: DrafterTrainJob, resume: bool) -> dict | None:
    """What shapes the head (the target, its layers, the draft vocabulary, TTT, the loss) and the course of its training
    (batches, seed, optimizer), to be written to the run folder (``start_run_folder``; None: a resumed run's, already
    there); a resumed run with other values is refused, naming them: its samples, vocabulary and checkpoint are of the
    first. The steps in all may change (a run extended or cut short)."""
    from tandem.configs.model import ModelConfig

    target = ModelConfig.from_dir(job.target_model)
    t = job.train
    settings = flat_settings(
        target_model=str(Path(job.target_model).resolve()),
        capture_layers=job.capture_layers or target.default_capture_layers(),
        draft_vocab_size=_draft_vocab_size(job, target.vocab_size), ttt_steps=t.ttt_steps, loss_type=t.loss_type,
        include_prompt_loss=t.include_prompt_loss, loss_decay=t.loss_decay, batch_size=t.batch_size,
        train_seed=t.seed, optim=t.optim,
        # (what shapes the responses the run folder keeps)
        max_new_tokens=job.max_new_tokens, temperature=job.temperature, seed=job.seed)
    return resumed_settings_check(job.run_path, settings, resume)


def start_run_folder(job: DrafterTrainJob, resume: bool, settings: dict | None) -> None:
    """Write ``settings`` (check_settings') to the run folder; a fresh run first clears an earlier run's files there."""
    if settings is None:
        return
    job.run_path.mkdir(parents=True, exist_ok=True)
    if not resume:  # a fresh run starts from nothing: a later --resume must not find an earlier run's files
        for name in (*RUN_FILES, STATE_FILE):
            (job.run_path / name).unlink(missing_ok=True)
    write_settings(job.run_path, settings)


def _draft_vocab_size(job: DrafterTrainJob, target_vocab: int) -> int:
    return job.draft_vocab_size or min(32000, target_vocab)


def heldout_metrics(head, teacher, eval_samples: list[Sample], vocab: DraftVocab, cfg) -> dict:
    """Draft loss and accuracy (draft argmax == target argmax) per TTT step on the held-out samples."""
    metrics = draft_metrics(head, teacher, eval_samples, vocab, cfg)
    accs = " ".join(f"{a:.2f}" for a in metrics["acc_by_step"])
    note(f"held-out draft loss {metrics['loss_weighted']:.3f} (step 0: {metrics['loss_by_step'][0]:.3f}); "
         f"accuracy by TTT step [{accs}]")
    return metrics
