"""A signal when this process's parent dies (Linux's PR_SET_PDEATHSIG): the one home of that call (a service started
by `tandem up`: tandem.service_runtime.die_with_launcher). Not for tensor-parallel ranks: the signal follows the
*thread* that started the process, and rank 0 starts its ranks from the engine loop's thread, which ends before the
engine shuts its ranks down."""

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
