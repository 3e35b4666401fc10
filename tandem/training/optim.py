"""AdamW with linear warm-up and cosine decay, and gradient clipping — shared by both trainers.

The learning rate is a pure function of the step, so a resumed run continues on the same curve
without saving scheduler state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)  # EAGLE-3's (0.9, 0.95)
    grad_clip: float = 0.5  # EAGLE-3 and SpecForge clip at 0.5


def lr_at(cfg: OptimConfig, step: int, total_steps: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    # No weight decay on norms (1-D): decaying them toward 0 fights the normalisation.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def optimizer_step(model: nn.Module, opt: torch.optim.Optimizer, cfg: OptimConfig, step: int, total: int) -> float:
    """Clip, set this step's learning rate, step, zero the grads; returns the pre-clip grad norm."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.grad_clip)
    lr = lr_at(cfg, step, total)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)
