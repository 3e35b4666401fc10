"""Triton's once-a-process cost, moved off the graph capture's path.

Before its first kernel lookup in a process, Triton hashes its own installation (``triton_key``: its Python sources
and the ~400 MB libtriton; about a second on the hosts measured) and keeps the result. Profiled at a
DeepSeek-V2-Lite target's first start (kernels on disk), that hash was the largest single piece of Triton's share
of the capture. Started in a thread while the weights load (the reads and hashlib release the GIL), the capture finds
it done.
"""

from __future__ import annotations

import threading

EARLY = True  # bench/capture_phases.py's "late" label times a start without it


def hash_triton_early() -> None:
    """Start ``triton_key`` in a daemon thread (nothing without Triton; at once done where it is cached). A lookup made
    before the thread ends hashes again beside it (no lock): at worst the hash is made twice at the same time."""
    if not EARLY:
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return
    threading.Thread(target=triton_key, name="triton-key", daemon=True).start()
