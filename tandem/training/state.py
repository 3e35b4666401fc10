"""Resumable training state: model + optimizer + step (+ whatever the trainer needs) in one file.

Written to a temporary name and renamed, so a run killed mid-save leaves the previous checkpoint
intact. Batches are a pure function of (seed, step) in both trainers, so model, optimizer and step
are all a resumed run needs to continue exactly where it stopped.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

STATE_FILE = "train_state.pt"


def save_state(run_dir: str | Path, model: nn.Module, opt: torch.optim.Optimizer, step: int, extra: dict | None = None) -> Path:
    path = Path(run_dir) / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "extra": extra or {}}, tmp)
    os.replace(tmp, path)
    return path


def load_state(run_dir: str | Path, model: nn.Module, opt: torch.optim.Optimizer | None) -> tuple[int, dict]:
    """Fill ``model`` (and ``opt``) from the run's checkpoint; returns (step, extra)."""
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training checkpoint to resume from (run without --resume first)")
    blob = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data only: no code runs
    model.load_state_dict(blob["model"])
    if opt is not None:
        opt.load_state_dict(blob["optimizer"])
    return int(blob["step"]), dict(blob.get("extra") or {})


def has_state(run_dir: str | Path) -> bool:
    return (Path(run_dir) / STATE_FILE).is_file()
