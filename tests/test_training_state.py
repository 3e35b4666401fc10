"""Resuming training loads tensors and plain data only (torch.load weights_only=True): a checkpoint that
carries a pickled object is refused and none of its code runs."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn

from tandem.training.state import STATE_FILE, load_state, save_state


def test_a_saved_state_resumes(tmp_path):
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    save_state(tmp_path, model, opt, 7, {"note": "x"})
    other = nn.Linear(3, 2)
    step, extra = load_state(tmp_path, other, torch.optim.AdamW(other.parameters()))
    assert step == 7 and extra == {"note": "x"} and torch.equal(other.weight, model.weight)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['TANDEM_TEST_MARKER']}",))


def test_a_state_carrying_code_is_refused_and_runs_nothing(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("TANDEM_TEST_MARKER", str(marker))
    torch.save({"model": {}, "optimizer": {}, "step": 1, "extra": {"x": _Payload()}}, tmp_path / STATE_FILE)
    with pytest.raises(pickle.UnpicklingError):
        load_state(tmp_path, nn.Linear(3, 2), None)
    assert not marker.exists()
