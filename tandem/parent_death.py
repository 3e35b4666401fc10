"""A signal when this process's parent dies (Linux's PR_SET_PDEATHSIG): the one home of that call, for a service
started by `tandem up` and for a tensor-parallel rank started by rank 0."""

from __future__ import annotations

import contextlib
import ctypes
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def signal_on_parent_death(signum: int) -> bool:
    """Ask for ``signum`` when the thread that started this process ends; → whether it was asked (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum) == 0
    return False
