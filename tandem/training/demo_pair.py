"""Recipes for the embedded demo pair: the stdlib-trained target and its EAGLE-3 head.

``tandem.training.demo.ensure_demo_target()`` / ``ensure_demo_draft()`` call ``build_demo_target`` /
``build_demo_draft`` once and cache the folders. Both recipes are sized for two CPU cores and a few
minutes each, and are deterministic (fixed seeds, fixed corpus split). The head trains on prompts cut
from the *training* stdlib files, each completed by the target itself (greedy, through our engine);
evaluation prompts come from the *held-out* files, which neither model has seen.

``tandem demo-models [--eval]`` builds (or finds) the pair and measures it.
``tandem demo-models --variant gpu --out DIR`` trains the larger variant on a GPU
(the ``gpu`` target preset and a head trained on the target's own longer continuations) into
``DIR/target`` and ``DIR/draft``, with the held-out prompts in ``DIR/prompts.json`` for the bench.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from tandem.training.eagle3_train import Eagle3TrainConfig
from tandem.training.lm import PRESETS, LMTrainConfig, train_lm
from tandem.training.optim import OptimConfig

DEMO_LM: LMTrainConfig = PRESETS["demo"]
DRAFT_PROMPTS = 1024  # training prompts (the target writes the responses: the slow part on a CPU)
PROMPT_TOKENS = 64  # prompts are 8..64 tokens of stdlib code, cut at line starts
RESPONSE_TOKENS = 160
EVAL_PROMPTS = 64
DRAFT_VOCAB = 1024  # of the target's 2048: covers essentially all tokens the target writes
# Inputs of layers 1, 2, 3 of the 4-layer target: low, middle and high as EAGLE-3 intends. The
# default [2, N//2, N-3] clamps to [1, 2, 2] at this depth, repeating a layer and leaving out the last.
CAPTURE_LAYERS = (1, 2, 3)
# TTT 5 = the depth of the chain the demo is evaluated with (5 steps); the prompt positions are
# trained too (their rows are computed anyway, so the extra signal is free). 8 epochs = 1024 steps:
# fewer leave the held-out accept length clearly shorter (docs/training.md).
DEMO_DRAFT = Eagle3TrainConfig(ttt_steps=5, batch_size=8, epochs=8.0, include_prompt_loss=True, checkpoint_every=64,
                               optim=OptimConfig(lr=2e-3, warmup_steps=30, grad_clip=0.5))
PROMPT_SEED, EVAL_SEED = 1, 2


@dataclass(frozen=True)
class GpuPairRecipe:
    """The larger pair, for GPU benchmarks on real acceptance: ~32 M-parameter target (8 layers x 512,
    vocabulary 8192, all of Lib/), its head trained with the default 7 TTT steps on 3072 continuations
    (6 epochs: at 4 the loss was still falling)."""
    lm: LMTrainConfig = PRESETS["gpu"]
    prompts: int = 3072
    response_tokens: int = 256
    eval_prompts: int = 64
    draft_vocab: int = 4096
    train: Eagle3TrainConfig = Eagle3TrainConfig(batch_size=32, epochs=6.0, include_prompt_loss=True, checkpoint_every=128,
                                                 optim=OptimConfig(lr=2e-3, warmup_steps=50, grad_clip=0.5))


def build_demo_target(out: Path) -> Path:
    """Train the demo LM into ``out`` (its run folder beside it keeps checkpoints: an interrupted
    build resumes where it stopped)."""
    out = Path(out)
    train_lm(DEMO_LM, out, out.with_name(out.name + ".run"), resume=True)
    return out


def _prompts(target_dir: str | Path, heldout: bool, count: int, seed: int, lm: LMTrainConfig = DEMO_LM) -> list[list[int]]:
    from tandem.training import corpus

    train_files, heldout_files = corpus.split_files(lm.corpus)
    tok = corpus.load_tokenizer(target_dir)
    return corpus.sample_prompts(tok, heldout_files if heldout else train_files, count, PROMPT_TOKENS, seed)


def demo_train_prompts(target_dir: str | Path, count: int = DRAFT_PROMPTS, seed: int = PROMPT_SEED) -> list[list[int]]:
    return _prompts(target_dir, False, count, seed)


def demo_eval_prompts(target_dir: str | Path, count: int = EVAL_PROMPTS, seed: int = EVAL_SEED) -> list[list[int]]:
    """Prompts from the stdlib files held out of both trainings."""
    return _prompts(target_dir, True, count, seed)


def demo_draft_job(target_dir: str | Path, out: Path, run_dir: Path | None = None, train: Eagle3TrainConfig = DEMO_DRAFT,
                   evaluate: bool = False, temperature: float = 0.0):
    from tandem.training.evaluate import EvalConfig
    from tandem.training.pipeline import DrafterTrainJob

    run_dir = run_dir or out.with_name(out.name + ".run")
    return DrafterTrainJob(target_model=str(target_dir), out=str(out), run_dir=str(run_dir),
                           max_new_tokens=RESPONSE_TOKENS, temperature=temperature, draft_vocab_size=DRAFT_VOCAB,
                           capture_layers=CAPTURE_LAYERS,
                           train=train, eval=EvalConfig() if evaluate else None)


def build_demo_draft(target_dir: str | Path, out: Path, run_dir: Path | None = None, evaluate: bool = False,
                     temperature: float = 0.0) -> dict:
    """Train the demo head into ``out``; returns the training summary (with held-out metrics).
    ``temperature``: of the target's responses it learns from (the shipped head: 0, greedy)."""
    from tandem.training.data import Sample
    from tandem.training.pipeline import run_job

    out = Path(out)
    job = demo_draft_job(target_dir, out, run_dir, evaluate=evaluate, temperature=temperature)
    samples = [Sample(tuple(p)) for p in demo_train_prompts(target_dir)]
    eval_samples = [Sample(tuple(p)) for p in demo_eval_prompts(target_dir)]
    # resume: an interrupted build reuses its generated samples and checkpoint
    return run_job(job, samples, eval_samples, resume=True)


def build_gpu_pair(out: Path, recipe: GpuPairRecipe = GpuPairRecipe(), device: str = "cuda") -> dict:
    """Train the larger variant into out/target and out/draft (resumable); → the head's summary
    (held-out draft metrics and the speculative evaluation: accept length at T=0 and T=1, tokens/s)."""
    from tandem.training.data import Sample
    from tandem.training.evaluate import EvalConfig
    from tandem.training.pipeline import DrafterTrainJob, run_job

    out = Path(out)
    target = out / "target"
    lm = dataclasses.replace(recipe.lm, device=device)
    if not (target / "config.json").is_file():
        train_lm(lm, target, out / "target.run", resume=True)
    eval_prompts = _prompts(target, True, recipe.eval_prompts, EVAL_SEED, lm)
    (out / "prompts.json").write_text(json.dumps(eval_prompts[:16]))  # what bench --sections demo decodes
    job = DrafterTrainJob(target_model=str(target), out=str(out / "draft"), run_dir=str(out / "draft.run"),
                          max_new_tokens=recipe.response_tokens, temperature=0.0, draft_vocab_size=recipe.draft_vocab,
                          device=device, train=recipe.train, eval=EvalConfig(speed_prompts=16))
    samples = [Sample(tuple(p)) for p in _prompts(target, False, recipe.prompts, PROMPT_SEED, lm)]
    return run_job(job, samples, [Sample(tuple(p)) for p in eval_prompts], resume=True)

