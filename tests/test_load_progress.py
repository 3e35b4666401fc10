"""A long checkpoint load reports its progress (tandem.models.loader._Progress): files and bytes read, from rank 0,
at most every PROGRESS_EVERY_S — here 0, so after every file; nothing for a load shorter than that."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from tandem.configs.model import ModelConfig
from tandem.models import loader
from tandem.models.registry import build_model


def _load(path: str) -> None:
    with torch.device("cpu"), loader.default_dtype(torch.float32):
        build_model(ModelConfig.from_dir(path)).load(path)


def test_a_sharded_load_reports_each_file_and_its_bytes(checkpoint, monkeypatch, caplog):
    ckpt = checkpoint("llama", seed=5, max_shard_size="50KB")
    files = sorted(Path(ckpt.path).glob("*.safetensors"))
    total_gb = sum(f.stat().st_size for f in files) / 1e9
    monkeypatch.setattr(loader, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="tandem.loader"):
        _load(ckpt.path)
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.loader"]
    assert len(files) > 2 and len(lines) == len(files), lines
    counts = [tuple(map(int, re.search(r"(\d+) of (\d+) files", line).groups())) for line in lines]
    assert counts == [(i, len(files)) for i in range(1, len(files) + 1)]
    assert f"({total_gb:.1f} of {total_gb:.1f} GB)" in lines[-1]


def test_a_quick_load_says_nothing(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="tandem.loader"):
        _load(checkpoint("llama", seed=5, max_shard_size="50KB").path)
    assert not [r for r in caplog.records if r.name == "tandem.loader"]
