"""Shared-memory names that arrive from a peer are checked against the project's own pattern before
anything is opened; links are never followed; a reader's mapping is read-only."""

from __future__ import annotations

import os

import pytest
import torch

from tandem.errors import ConfigError
from tandem.ring import HiddenRing, HiddenRingView, RingAttachError, RingSpec, posix


@pytest.mark.parametrize("name", ["../etc/passwd", "tandem-../../x", "tandem-a/b", "/tandem-1", "tandem-", "tandem",
                                  "TANDEM-1", "tandem-1-", "torch_1_2_3", "tandem-1\n", "tandem-" + "a" * 200, ""])
def test_foreign_names_are_refused_before_anything_is_opened(name):
    with pytest.raises(ValueError):
        posix.check_name(name)
    with pytest.raises(ValueError):
        posix.open_segment(name, 8)
    with pytest.raises(ConfigError):
        RingSpec(kind="posix", name=name, num_rows=1, row_width=1, dtype="float32", owner_pid=1)


def test_the_projects_own_names_pass():
    with HiddenRing.create(4, 2, "float32") as ring:
        assert posix.check_name(ring.spec.name) == ring.spec.name
    for name in ("tandem-123-0a1b2c3d", "tandem-flags-123-0a1b2c3d"):
        assert posix.check_name(name) == name


def test_a_link_with_a_good_name_is_not_followed(tmp_path):
    target = tmp_path / "file"
    target.write_bytes(b"\0" * 64)
    link = "/dev/shm/tandem-link-1"
    os.symlink(target, link)
    try:
        with pytest.raises(OSError):
            posix.open_segment("tandem-link-1", 8)
        with pytest.raises(RingAttachError):
            HiddenRingView.attach(RingSpec(kind="posix", name="tandem-link-1", num_rows=2, row_width=2,
                                           dtype="float32", owner_pid=1))
    finally:
        os.unlink(link)


def test_a_read_only_view_cannot_write_the_owners_ring():
    with HiddenRing.create(4, 2, "float32") as ring:
        ring.tensor.copy_(torch.arange(8.0).view(4, 2))
        view = HiddenRingView.attach(ring.spec, writable=False)
        assert torch.equal(view.read(1, 2), ring.tensor[1:3])
        mapping = posix.open_segment(ring.spec.name, ring.spec.nbytes, writable=False)
        with pytest.raises(TypeError):  # mmap: "mmap can't modify a readonly memory map"
            mapping[0:1] = b"x"
        view.close()
