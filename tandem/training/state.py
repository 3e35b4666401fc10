"""Resumable training state: model + optimizer + step (+ whatever the trainer needs) in one file.

Written to a temporary name and renamed, so a run killed mid-save leaves the previous checkpoint
intact. Batches are a pure function of (seed, step) in both trainers, so model, optimizer and step
are all a resumed run needs to continue exactly where it stopped — with the settings it began with, which the run
folder keeps (``settings.json``): a resume that asks for others is refused, naming them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from torch import nn

from tandem.errors import ConfigError

STATE_FILE = "train_state.pt"
SETTINGS_FILE = "settings.json"


def flat_settings(**values) -> dict:
    """``values`` as settings.json holds them: a dataclass spread into ``name.field`` entries, tuples as lists."""
    out = {}
    for name, value in values.items():
        if dataclasses.is_dataclass(value):
            out.update({f"{name}.{k}": v for k, v in dataclasses.asdict(value).items()})
        else:
            out[name] = value
    return json.loads(json.dumps(out))


def write_settings(run_dir: str | Path, settings: dict) -> None:
    (Path(run_dir) / SETTINGS_FILE).write_text(json.dumps(settings, indent=1) + "\n")


def resumed_settings_check(run_dir: str | Path, settings: dict, resume: bool) -> dict | None:
    """``settings`` (flat_settings') to write to the run folder, or None where a resumed run's are there already; a
    resume that asks for other values than the run began with is refused, naming them (a setting the run's file does
    not hold, written by an earlier version, is not compared)."""
    path = Path(run_dir) / SETTINGS_FILE
    if not (resume and path.is_file()):
        return settings
    before = json.loads(path.read_text())
    changed = [f"{k} {before[k]!r} → {v!r}" for k, v in settings.items() if k in before and before[k] != v]
    if changed:
        raise ConfigError(f"--resume of {path.parent} with other settings ({'; '.join(changed)}): resume with the "
                          "first run's, or start a new run folder")
    return None


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
