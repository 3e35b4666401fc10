"""Writing a safetensors file the way every writer here should: whole or not at all (a temporary sibling, renamed
over the target), and readable as any file this process creates (``safetensors``' ``save_file`` creates its files
0600: a head trained by one user could not be served by a service running as another, compose's included)."""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import save_file


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)  # (no /proc: read it by setting it; brief)
        os.umask(mask)
        return mask


def write_safetensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """``tensors`` (contiguous) to ``path``, mode 0666 less the umask; a failure (a full disk) leaves no partial file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
