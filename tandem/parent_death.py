"""Ending with the parent. A signal when this process's parent dies (Linux's PR_SET_PDEATHSIG): the one home of that
call (a service started by `tandem up`: tandem.service_runtime.die_with_launcher). Not for tensor-parallel ranks: the
signal follows the *thread* that started the process, and rank 0 starts its ranks from the engine loop's thread, which
ends before the engine shuts its ranks down; a rank started by ``multiprocessing`` watches its parent process's
sentinel instead (``exit_with_parent_process``)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import sys
import threading
from multiprocessing.connection import wait

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def signal_on_parent_death(signum: int) -> bool:
    """Ask for ``signum`` when the thread that started this process ends; → whether it was asked (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum) == 0
    return False


def exit_with_parent_process(what: str) -> bool:
    """In a process started by ``multiprocessing``: exit (code 1, after one log line naming ``what``) as soon as the
    parent process ends, however it ends. A tensor-parallel rank blocked in an NCCL collective waits for a rank 0 that
    was killed outright forever, holding its GPU's memory; a thread waiting on the parent's sentinel (a pipe the parent
    holds, closed by the kernel when it dies) ends it. The main thread may sit in the collective: the GIL is free
    there. → whether the watch started (False: not a ``multiprocessing`` child)."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return False

    def watch() -> None:
        wait([parent.sentinel])
        logging.getLogger("tandem.parent_death").error("%s: the parent process (pid %s) ended; exiting", what, parent.pid)
        os._exit(1)

    threading.Thread(target=watch, name="tandem-parent-watch", daemon=True).start()
    return True
