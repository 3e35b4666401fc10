"""write_safetensors (tandem/safetensors_file.py): the file is readable as any file this process creates (safetensors'
own save_file makes it 0600), and a write that fails leaves neither a partial file nor a damaged previous one."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from tandem.safetensors_file import write_safetensors


def test_the_file_takes_the_umask_not_0600(tmp_path):
    previous = os.umask(0o022)
    try:
        path = write_safetensors({"a": torch.arange(3.0)}, tmp_path / "m.safetensors")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert torch.equal(load_file(path)["a"], torch.arange(3.0))


def test_a_failed_write_leaves_the_previous_file_and_no_partial(tmp_path, monkeypatch):
    from tandem import safetensors_file

    path = write_safetensors({"a": torch.zeros(2)}, tmp_path / "m.safetensors")

    def disk_full(tensors, filename, metadata=None):  # half a file written, then the disk is full
        with open(filename, "wb") as f:
            f.write(b"\x00" * 5)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_file, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_safetensors({"a": torch.ones(2)}, path)
    assert torch.equal(load_file(path)["a"], torch.zeros(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
