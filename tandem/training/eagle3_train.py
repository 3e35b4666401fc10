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
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.models.eagle3_checkpoint import random_draft_config, save_eagle3
from tandem.models.eagle3_config import DraftConfig
from tandem.training.data import Sample
from tandem.training.eagle3_dense import DenseEagle3
from tandem.training.lm import use_bf16
from tandem.training.optim import OptimConfig, make_optimizer, optimizer_step
from tandem.training.progress import Progress, note
from tandem.training.state import has_state, load_state, save_state
from tandem.training.teacher import TargetTeacher
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


class TTTLoss:
    """Targets of one batch, computed once from the teacher's logits, then sliced per TTT step."""

    def __init__(self, samples: list[Sample], teach, vocab: DraftVocab, t2d_index: torch.Tensor,
                 steps: int, include_prompt: bool, device):
        B, T = len(samples), max(len(s.tokens) for s in samples)
        Vd = vocab.size
        self.tokens = torch.zeros(B, T, dtype=torch.int64)
        self.features = torch.zeros(B, T, teach[0][0].shape[-1])
        self.target_p = torch.zeros(B, T + steps, Vd)  # padded right so every step can slice R rows
        self.target_id = torch.full((B, T + steps), -1, dtype=torch.int64)  # target argmax as a draft id
        self.mask = torch.zeros(B, T + steps, dtype=torch.bool)
        used = vocab.used
        for b, (s, (feats, logits)) in enumerate(zip(samples, teach)):
            n = len(s.tokens)
            self.tokens[b, :n] = torch.tensor(s.tokens)
            self.features[b, :n] = feats.float().cpu()
            logits = logits.float().cpu()
            self.target_p[b, :n] = torch.softmax(logits[:, used], dim=-1)
            self.target_id[b, :n] = t2d_index[logits.argmax(-1)]
            # position p predicts x_{p+1}; trained when that is a response token (or always)
            first = 0 if include_prompt else len(s.prompt) - 1
            self.mask[b, first:n] = True
        self.mask &= self.target_id >= 0  # the draft cannot propose a token outside its vocabulary
        self.tokens, self.features = self.tokens.to(device), self.features.to(device)
        self.target_p, self.target_id, self.mask = self.target_p.to(device), self.target_id.to(device), self.mask.to(device)
        self.num_tokens = int(sum(len(s.tokens) for s in samples))

    def step_terms(self, k: int, logits: torch.Tensor, loss_type: str) -> tuple[torch.Tensor, float, int]:
        """(loss_k, accuracy_k, counted positions) for step k's logits [B, R, Vd] (rows t ↔ p = t+k+1)."""
        R = logits.shape[1]
        sl = slice(k + 1, k + 1 + R)
        mask = self.mask[:, sl]
        count = int(mask.sum())
        if count == 0:
            return logits.sum() * 0.0, float("nan"), 0
        logp = F.log_softmax(logits.float(), dim=-1)[mask]  # [N, Vd]
        if loss_type == "hard":
            loss = F.nll_loss(logp, self.target_id[:, sl][mask])
        else:
            loss = -(self.target_p[:, sl][mask] * logp).sum(-1).mean()
        acc = float((logp.argmax(-1) == self.target_id[:, sl][mask]).float().mean())
        return loss, acc, count


def run_ttt(head: DenseEagle3, teacher: TargetTeacher, samples: list[Sample], vocab: DraftVocab, t2d_index,
            cfg: Eagle3TrainConfig, bf16: bool):
    """Teacher forward + TTT unroll of one batch → (weighted loss, per-step losses, per-step accuracies, tokens)."""
    teach = teacher.forward([s.tokens for s in samples])
    dev = head.fc.weight.device
    tgt = TTTLoss(samples, teach, vocab, t2d_index, cfg.ttt_steps, cfg.include_prompt_loss, dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        step_logits = head.ttt(tgt.tokens, tgt.features, cfg.ttt_steps)
    total, losses, accs = 0.0, [], []
    for k, logits in enumerate(step_logits):
        loss_k, acc_k, _ = tgt.step_terms(k, logits, cfg.loss_type)
        total = total + cfg.loss_decay**k * loss_k
        losses.append(float(loss_k.detach()))
        accs.append(acc_k)
    return total, losses, accs, tgt.num_tokens


@torch.no_grad()
def draft_metrics(head: DenseEagle3, teacher: TargetTeacher, samples: list[Sample], vocab: DraftVocab,
                  cfg: Eagle3TrainConfig, batch: int = 16) -> dict:
    """Mean per-step loss and accuracy (draft argmax == target argmax) over ``samples``."""
    was_training = head.training
    head.eval()
    t2d_index = vocab.target_to_draft()
    bf16 = use_bf16(cfg.precision, head.fc.weight.device)
    sums = [[0.0, 0.0, 0] for _ in range(cfg.ttt_steps)]
    for i in range(0, len(samples), batch):
        part = samples[i : i + batch]
        teach = teacher.forward([s.tokens for s in part])
        tgt = TTTLoss(part, teach, vocab, t2d_index, cfg.ttt_steps, cfg.include_prompt_loss, head.fc.weight.device)
        with torch.autocast(head.fc.weight.device.type, dtype=torch.bfloat16, enabled=bf16):
            step_logits = head.ttt(tgt.tokens, tgt.features, cfg.ttt_steps)
        for k, logits in enumerate(step_logits):
            loss_k, acc_k, n = tgt.step_terms(k, logits, cfg.loss_type)
            if n:
                sums[k][0] += float(loss_k) * n
                sums[k][1] += acc_k * n
                sums[k][2] += n
    head.train(was_training)
    losses = [s[0] / s[2] if s[2] else float("nan") for s in sums]
    accs = [s[1] / s[2] if s[2] else float("nan") for s in sums]
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
        note(f"resumed EAGLE-3 training at step {start} of {total}")
    bf16 = use_bf16(cfg.precision, torch.device(cfg.device))
    t2d_index = vocab.target_to_draft()
    params = sum(p.numel() for p in head.parameters())
    note(f"EAGLE-3 head: {params / 1e6:.2f} M parameters, draft vocab {vocab.size} (covers {vocab.coverage:.1%} of "
         f"response tokens), capture layers {list(teacher.capture_layers)}, {len(samples)} samples, {total} steps, TTT {cfg.ttt_steps}")
    bar = Progress("eagle3", total, start)
    ema: dict[str, float] = {}
    started = time.perf_counter()
    head.train()
    for step in range(start, total):
        batch = [samples[i] for i in batch_indices(len(samples), cfg.batch_size, cfg.seed, step)]
        loss, losses, accs, ntok = run_ttt(head, teacher, batch, vocab, t2d_index, cfg, bf16)
        loss.backward()
        optimizer_step(head, opt, cfg.optim, step, total)
        for key, value in (("loss", float(loss.detach())), ("acc0", accs[0]), (f"acc{cfg.ttt_steps - 1}", accs[-1])):
            if not math.isnan(value):
                ema[key] = value if key not in ema else 0.9 * ema[key] + 0.1 * value
        done = step + 1
        if done % cfg.checkpoint_every == 0 or done == total:
            save_state(run_dir, head, opt, done)
        bar.update(done, ntok, **ema)
    bar.close()
    export(head, draft_cfg, out_dir)
    return head, {"steps": total, "train_ema": ema, "seconds_this_run": round(time.perf_counter() - started, 1),
            "draft_vocab_size": vocab.size, "vocab_coverage": vocab.coverage, "head_parameters": params}


def export(head: DenseEagle3, draft_cfg: DraftConfig, out_dir: str | Path) -> Path:
    """The SGLang/SpecForge folder: state_dict names are already the checkpoint's."""
    state = {k: v.detach().float() if v.is_floating_point() else v for k, v in head.state_dict().items()}
    return save_eagle3(state, dataclasses.replace(draft_cfg, dtype="float32"), out_dir)
