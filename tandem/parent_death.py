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
import time
from multiprocessing.connection import wait

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def signal_on_parent_death(signum: int) -> bool:
    """Ask for ``signum`` when the thread that started this process ends; → whether it was asked (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum) == 0
    return False


def exit_with_parent_process(what: str, parent_pid: int | None = None) -> bool:
    """In a process started by ``multiprocessing``: exit (code 1, after one log line naming ``what``) as soon as the
    parent process ends, however it ends. A tensor-parallel rank blocked in an NCCL collective waits for a rank 0 that
    was killed outright forever, holding its GPU's memory; a thread waiting on the parent's sentinel (a pipe the parent
    holds, closed by the kernel when it dies) ends it. The main thread may sit in the collective: the GIL is free
    there. ``parent_pid``: the process that started it, where ``multiprocessing`` names another (its fork server).
    → whether the watch started (False: not a ``multiprocessing`` child)."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return False
    pid = parent_pid if parent_pid is not None else parent.pid

    def watch() -> None:
        wait([parent.sentinel])
        # Started through a fork server (the CPU's), the sentinel follows that server, which a signal to the process
        # group may end while the parent lives on: the parent's pid decides.
        while process_alive(pid):
            time.sleep(0.5)
        logging.getLogger("tandem.parent_death").error("%s: the parent process (pid %s) ended; exiting", what, pid)
        os._exit(1)

    threading.Thread(target=watch, name="tandem-parent-watch", daemon=True).start()
    return True


def process_alive(pid: int | None) -> bool:
    """Whether process ``pid`` runs (not a zombie: one that ended and awaits its reaping is gone)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except PermissionError:
            return True  # (another user's process)
        except OSError:
            return False
        return not sys.platform.startswith("linux")  # (Linux without /proc/PID: gone)
