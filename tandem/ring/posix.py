"""POSIX shared-memory segments in /dev/shm, and the watchdog that unlinks them when their owner dies.

Both sides use ``os.open`` + ``mmap`` on /dev/shm (Linux) instead of
``multiprocessing.shared_memory``: on Python < 3.13 that class registers even *attached* segments
with the resource tracker, which unlinks them when the attaching process exits (and warns about
"leaked" memory), so a drafter that exits or restarts would destroy the verifier's ring.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import subprocess
import sys
from collections.abc import Sequence

SHM_DIR = "/dev/shm"
# Every segment this project makes is named tandem-<pid>-<hex> or tandem-<kind>-<pid>-<hex>. Names that
# arrive from a peer (the verifier's Hello) are checked against it before anything is opened: no
# slash, no "..", nothing outside /dev/shm.
SEGMENT_NAME = re.compile(r"tandem-[a-z0-9]+(?:-[a-z0-9]+)*")
_MAX_NAME = 96


def check_name(name: str) -> str:
    """``name`` if it is one of this project's segment names, else ValueError (never echoing it whole)."""
    if not isinstance(name, str) or len(name) > _MAX_NAME or SEGMENT_NAME.fullmatch(name) is None:
        raise ValueError(f"{name[:_MAX_NAME]!r} is not a Tandem shared-memory segment name (tandem-<pid>-<hex>)")
    return name


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name.lstrip("/"))


def create_segment(name: str, nbytes: int) -> mmap.mmap:
    """Create ``name`` exclusively (0600) with ``nbytes`` reserved, and map it read/write."""
    path = shm_path(check_name(name))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        # Reserve the pages now: tmpfs grows lazily, so a bare ftruncate "succeeds" and the first
        # write beyond the free space kills the writer with SIGBUS. This turns that into ENOSPC here.
        os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes)  # mmap keeps its own duplicate of fd
    except OSError as e:
        unlink(path)
        raise OSError(e.errno, f"cannot create the {nbytes / 2**20:.1f} MiB segment {path}: {e.strerror} "
                               f"(in Docker, raise shm_size or use ipc: host)") from e
    finally:
        os.close(fd)


def open_segment(name: str, nbytes: int, writable: bool = True) -> mmap.mmap:
    """Map an existing segment (read-only unless ``writable``); FileNotFoundError if it is gone,
    ValueError if the name is not one of ours, or the file is a link, not a regular file of this user,
    or too small. The name comes from a peer: it is checked, and a symlink is never followed."""
    path = shm_path(check_name(name))
    fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise ValueError(f"segment {path} is not a regular file of this user")
        if st.st_size < nbytes:
            raise ValueError(f"segment {path} has {st.st_size} bytes, {nbytes} expected")
        return mmap.mmap(fd, nbytes, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# The watchdog is a bare interpreter (-I -S: no site, starts in ~50 ms) that blocks reading a pipe
# whose only write end the owner holds. The read returns EOF when the owner closes it or when the
# kernel closes it because the owner died, by any signal, SIGKILL included; then it unlinks its
# arguments (paths, or glob patterns for files whose exact name is only known later).
# It ignores SIGINT/SIGTERM so that a Ctrl-C or a group-wide SIGTERM cannot kill it before the owner:
# the owner's own death is what releases it.
_WATCHDOG_SRC = """\
import glob, os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
while os.read(0, 4096):
    pass
for arg in sys.argv[1:]:
    for p in glob.glob(arg) if "*" in arg else [arg]:
        try:
            os.unlink(p)
        except OSError:
            pass
"""

# Write ends held by this process; a fork()ed child (no exec) inherits them and must close its copies,
# otherwise the pipe would stay open after the owner dies and the watchdog would wait for the child.
_PIPES: set[int] = set()


def _close_inherited_pipes() -> None:
    for w in _PIPES:
        try:
            os.close(w)
        except OSError:
            pass
    _PIPES.clear()


os.register_at_fork(after_in_child=_close_inherited_pipes)


class Watchdog:
    """Unlinks ``paths`` (globs allowed) once the creating process dies, or when ``stop()`` is called."""

    def __init__(self, paths: Sequence[str]):
        r, w = os.pipe()  # both ends close-on-exec, so no other subprocess inherits the write end
        try:
            # A new session keeps terminal and process-group signals away from it.
            self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG_SRC, *paths], stdin=r,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        self._w, self._pid = w, os.getpid()
        _PIPES.add(w)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> None:
        """Unlink now (idempotent with the owner's own unlink) and reap the watchdog; owner only."""
        if os.getpid() != self._pid or self._w < 0:
            return
        _PIPES.discard(self._w)
        os.close(self._w)
        self._w = -1
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # it still exits on its own; nothing to leak but a zombie
            pass
