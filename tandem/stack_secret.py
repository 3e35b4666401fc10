"""Where ``tandem up`` keeps its stack's internal secret (tandem.internal_secret) for the services it starts: a private
folder under the temporary directory, named ``tandem-up-<launcher pid>@<host>-<random>``, removed when the launcher stops.
A launcher killed outright removes nothing, so each start first clears the folders of launchers that are gone — on
this host only (containers sharing /tmp have pid namespaces of their own), and only the user's own."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

from tandem.parent_death import process_alive

PREFIX = "tandem-up-"


def write(value: str) -> str:
    """Write ``value`` into a new private folder (0700, the file 0600) and return the file's path; the caller removes
    the folder when it stops."""
    _remove_orphaned()
    folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}@{socket.gethostname()}-")
    path = os.path.join(folder, "internal-secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value)
    return path


def _remove_orphaned() -> None:
    root, host = tempfile.gettempdir(), socket.gethostname()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        pid, _, rest = name.removeprefix(PREFIX).partition("@")
        if not (name.startswith(PREFIX) and pid.isdigit() and rest.rsplit("-", 1)[0] == host) or process_alive(int(pid)):
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path, follow_symlinks=False).st_uid == os.getuid():  # (another user's folder is theirs)
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


