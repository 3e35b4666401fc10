"""EAGLE-3 head training with training-time test (TTT), against the target's own distribution.

Per step: a batch of samples (prompt + target response) goes through the target (``TargetTeacher``:
online features and logits via our engine), then through the head's K-step TTT unroll
(``DenseEagle3.ttt``). Step k's loss is the soft cross-entropy between the target's next-token
distribution restricted to the draft vocabulary (renormalised) and the head's, over positions whose
target argmax the draft vocabulary contains (EAGLE-3's and SpecForge's choice: it teaches the whole
distribution, which sampled verification needs, not only the argmax); ``loss_type="hard"`` uses the
target's argmax as a label instead. Total loss = Σ_k decay^k · loss_k; AdamW, warm-up + cosine,
clipping. Batches are a pure function of (seed, step): ``resume`` continues exactly.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.models.eagle3_checkpoint import random_draft_config, save_eagle3
from tandem.configs.eagle3 import DraftConfig
from tandem.training.data import Sample
from tandem.training.eagle3_dense import DenseEagle3
from tandem.training.lm import use_bf16
from tandem.training.optim import OptimConfig, make_optimizer, optimizer_step
from tandem.training.progress import Progress, note
from tandem.errors import TandemError
from tandem.training.state import has_state, load_state, save_state
from tandem.training.teacher import TargetTeacher
from tandem.training.ttt_batch import make_batch, ttt_loss
from tandem.training.vocab import DraftVocab


@dataclass(frozen=True)
class Eagle3TrainConfig:
    ttt_steps: int = 7  # K: SpecForge's and EAGLE's training length
    loss_decay: float = 0.8  # weight of step k is decay**k
    loss_type: str = "soft"  # soft: target distribution; hard: target argmax
    batch_size: int = 8
    epochs: float = 2.0
    max_steps: int | None = None  # overrides epochs
    optim: OptimConfig = OptimConfig(lr=2e-3, warmup_steps=30, weight_decay=0.0, grad_clip=0.5)
    include_prompt_loss: bool = False  # also learn the target's distribution at prompt positions
    init_from_target: bool = True  # start lm_head/norm from the target's rows (see DenseEagle3.init_weights)
    checkpoint_every: int = 100
    seed: int = 0
    device: str = "cpu"
    precision: str = "auto"  # auto: bf16 autocast on GPUs and AMX CPUs, else float32
    compile: bool = True  # torch.compile the TTT step (~1.3-1.5x on CPU after a one-time compile)

    def total_steps(self, num_samples: int) -> int:
        if self.max_steps is not None:
            return self.max_steps
        return max(1, math.ceil(self.epochs * num_samples / self.batch_size))


def draft_config_for(target_cfg, capture_layers: tuple[int, ...], draft_vocab_size: int) -> DraftConfig:
    """One target-shaped decoder layer; eagle_aux_hidden_state_layer_ids name layer *outputs*, so
    they are our capture layers (layer inputs) minus one."""
    return random_draft_config(target_cfg, draft_vocab_size, aux_layer_ids=tuple(c - 1 for c in capture_layers))


def batch_indices(num_samples: int, batch: int, seed: int, step: int) -> list[int]:
    """A fresh permutation per epoch, sliced by step: a pure function of (seed, step)."""
    per_epoch = max(1, num_samples // batch)
    epoch, slot = divmod(step, per_epoch)
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    return perm[slot * batch : slot * batch + batch].tolist()


class StepFunction:
    """Teacher forward + padded batch + TTT loss for one training step; under ``torch.compile`` when
    asked (batches are then padded to one length, so it compiles once), eagerly if compiling fails."""

    def __init__(self, head: DenseEagle3, teacher: TargetTeacher, vocab: DraftVocab, cfg: Eagle3TrainConfig,
                 pad_to: int | None):
        self.head, self.teacher, self.cfg = head, teacher, cfg
        self.used, self.t2d_index = vocab.used, vocab.target_to_draft()
        self.bf16 = use_bf16(cfg.precision, head.fc.weight.device)
        self.pad_to = pad_to
        self.compiled = torch.compile(self._loss, dynamic=False) if cfg.compile else None

    def _loss(self, tokens, features, target_p, target_id, mask):
        c = self.cfg
        return ttt_loss(self.head, tokens, features, target_p, target_id, mask, steps=c.ttt_steps,
                        decay=c.loss_decay, hard=c.loss_type == "hard", bf16=self.bf16)

    def __call__(self, samples: list[Sample], train: bool = True):
        teach = self.teacher.teach(samples)
        c = self.cfg
        batch = make_batch(samples, teach, self.used, self.t2d_index, c.ttt_steps, c.include_prompt_loss and train,
                           self.head.fc.weight.device, self.pad_to if train and self.compiled else None)
        args = (batch.tokens, batch.features, batch.target_p, batch.target_id, batch.mask)
        if train and self.compiled is not None:
            try:
                return (*self.compiled(*args), batch.num_tokens)
            except Exception as e:  # no C++ compiler, an unsupported op...: eager is slower, not wrong
                note(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}); training eagerly")
                self.compiled = None
        return (*self._loss(*args), batch.num_tokens)


@torch.no_grad()
def draft_metrics(head: DenseEagle3, teacher: TargetTeacher, samples: list[Sample], vocab: DraftVocab,
                  cfg: Eagle3TrainConfig, batch: int = 16) -> dict:
    """Mean per-step loss and accuracy (draft argmax == target argmax) over the *response* positions
    of ``samples`` (whatever the training mask was: comparable across configs, and what speculation
    faces)."""
    was_training = head.training
    head.eval()
    step = StepFunction(head, teacher, vocab, dataclasses.replace(cfg, compile=False), None)
    sums = torch.zeros(3, cfg.ttt_steps, dtype=torch.float64)
    for i in range(0, len(samples), batch):
        _, losses, accs, counts, _ = step(samples[i : i + batch], train=False)
        sums += torch.stack([losses * counts, accs * counts, counts]).double().cpu()
    head.train(was_training)
    losses = (sums[0] / sums[2]).tolist()
    accs = (sums[1] / sums[2]).tolist()
    weighted = sum(cfg.loss_decay**k * l for k, l in enumerate(losses))
    return {"loss_by_step": losses, "acc_by_step": accs, "loss_weighted": weighted}


def build_head(target_dir: str, draft_cfg: DraftConfig, vocab: DraftVocab, cfg: Eagle3TrainConfig, max_positions: int) -> DenseEagle3:
    from safetensors import safe_open

    from tandem.models.loader import checkpoint_files

    files = checkpoint_files(Path(target_dir))

    def tensor(name: str) -> torch.Tensor | None:
        if name not in files:
            return None
        with safe_open(str(files[name]), framework="pt") as f:
            return f.get_tensor(name).float()

    embed = tensor("model.embed_tokens.weight")
    lm_head = tensor("lm_head.weight")
    lm_head = embed if lm_head is None else lm_head  # tied targets
    head = DenseEagle3(draft_cfg, embed, max_positions)
    head.set_vocab(vocab.d2t, vocab.t2d)
    if cfg.init_from_target:
        head.init_weights(cfg.seed, lm_head, tensor("model.norm.weight"))
    else:
        head.init_weights(cfg.seed)
    return head.to(cfg.device)


def train_eagle3(teacher: TargetTeacher, target_dir: str, samples: list[Sample], vocab: DraftVocab,
                 cfg: Eagle3TrainConfig, out_dir: str | Path, run_dir: str | Path,
                 resume: bool = False) -> tuple[DenseEagle3, dict]:
    """Train on ``samples`` (all with responses), export the SGLang-format folder ``out_dir``;
    returns the trained head and a summary."""
    run_dir = Path(run_dir)
    target_cfg = teacher.engine.model_config
    draft_cfg = draft_config_for(target_cfg, teacher.capture_layers, vocab.size)
    longest = max(len(s.tokens) for s in samples)
    head = build_head(target_dir, draft_cfg, vocab, cfg, max(target_cfg.max_position_embeddings, longest) + cfg.ttt_steps)
    opt = make_optimizer(head, cfg.optim)
    total = cfg.total_steps(len(samples))
    start = 0
    if resume and has_state(run_dir):
        start, _ = load_state(run_dir, head, opt)
        note(f"resumed EAGLE-3 training at step {start} of {total}" if start <= total else
             f"the run folder holds step {start}, past the {total} steps asked: nothing more to train; the head "
             f"written holds {start} steps")
    # Padding every batch to the longest sample lets torch.compile specialise once.
    step_fn = StepFunction(head, teacher, vocab, cfg, pad_to=-(-longest // 32) * 32)
    params = sum(p.numel() for p in head.parameters())
    covers = "" if math.isnan(vocab.coverage) else f" (covers {vocab.coverage:.1%} of the counted tokens)"
    note(f"EAGLE-3 head: {params / 1e6:.2f} M parameters, draft vocab {vocab.size}{covers}, capture layers "
         f"{list(teacher.capture_layers)}, {len(samples)} samples, {total} steps, TTT {cfg.ttt_steps}")
    if cfg.compile:
        note("compiling the training step (torch.compile; --no-compile skips it): the first step takes longer")
    bar = Progress("eagle3", total, start)
    ema: dict[str, float] = {}
    started = time.perf_counter()
    head.train()
    try:
        _train_steps(head, opt, step_fn, samples, cfg, range(start, total), run_dir, bar, ema)
    finally:
        bar.close()
    export(head, draft_cfg, out_dir)
    return head, {"steps": max(start, total), "train_ema": ema,
                  "seconds_this_run": round(time.perf_counter() - started, 1), "draft_vocab_size": vocab.size,
                  # (a vocabulary read back from a resumed run has no counts: null, not NaN, which JSON lacks)
                  "vocab_coverage": None if math.isnan(vocab.coverage) else vocab.coverage, "head_parameters": params}


class TrainingInterrupted(TandemError):
    """Training stopped by an interrupt, the last whole step saved."""


def _train_steps(head, opt, step_fn, samples, cfg, steps: range, run_dir: Path, bar, ema: dict) -> None:
    """The steps of ``steps``, a checkpoint every ``cfg.checkpoint_every`` and at the end — and, at SIGINT or SIGTERM,
    of the step under way once it is whole: the signals only ask (in the main thread), the loop stops between steps,
    so no checkpoint holds a step half applied or applied and not counted."""
    total, asked = steps.stop, []
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, lambda signum, frame: asked.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for step in steps:
            ntok = _one_step(head, opt, step_fn, samples, cfg, step, total, ema)
            done = step + 1
            if done % cfg.checkpoint_every == 0 or done == total or asked:
                save_state(run_dir, head, opt, done)
            bar.update(done, ntok, **ema)
            if asked and done < total:
                raise TrainingInterrupted(f"interrupted; the run folder {run_dir} holds step {done} of {total}: "
                                          "--resume continues from there")
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def _one_step(head, opt, step_fn, samples, cfg, step: int, total: int, ema: dict) -> int:
    """One optimizer step; → the tokens it trained on."""
    batch = [samples[i] for i in batch_indices(len(samples), cfg.batch_size, cfg.seed, step)]
    loss, _, accs, counts, ntok = step_fn(batch)
    loss.backward()
    optimizer_step(head, opt, cfg.optim, step, total)
    accs = torch.where(counts > 0, accs, torch.nan).tolist()
    for key, value in (("loss", float(loss.detach())), ("acc0", accs[0]), (f"acc{cfg.ttt_steps - 1}", accs[-1])):
        if not math.isnan(value):
            ema[key] = value if key not in ema else 0.9 * ema[key] + 0.1 * value
    return ntok


TRAINED_MARK = "tandem_training"  # the config.json key that says this trainer wrote the head (cli: --out checks)


def export(head: DenseEagle3, draft_cfg: DraftConfig, out_dir: str | Path) -> Path:
    """The SGLang/SpecForge folder: state_dict names are already the checkpoint's; its config marked as ours."""
    state = {k: v.detach().float() if v.is_floating_point() else v for k, v in head.state_dict().items()}
    out = Path(out_dir)
    return save_eagle3(state, dataclasses.replace(draft_cfg, dtype="float32"), out,
                       config_extra={TRAINED_MARK: {"run_dir": str(out.with_name(out.name + ".run"))}})
