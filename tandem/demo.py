"""The embedded demo model: what ``tandem generate``/``tandem up`` serve when no model is given.

Nothing can be downloaded, so the demo is built locally on first use and cached (under
``$TANDEM_CACHE`` or ``~/.cache/tandem``): a byte-level BPE tokenizer trained on the Python standard
library's own source (present on every machine), a small Llama-architecture target *trained* on that
source, and its EAGLE-3 head trained on the target's own continuations of stdlib prompts (recipes in
``tandem.training.demo_pair``). Each takes a few minutes on two CPU cores the first time, with
progress on stderr; an interrupted build resumes from its checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger("tandem.demo")

DEMO_VERSION = "v2-trained"


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


@contextlib.contextmanager
def _build_lock(folder: Path):
    """One builder at a time: services started together must not both train the same model."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_demo_target() -> Path:
    """Build (once) and return the demo target's folder."""
    out = cache_root() / "demo" / DEMO_VERSION / "target"
    if (out / "config.json").is_file():
        return out
    with _build_lock(out.parent):
        if not (out / "config.json").is_file():  # another process may have built it meanwhile
            from tandem.training.demo_pair import build_demo_target

            log.warning("training the demo target in %s (first use only; a few minutes)", out)
            build_demo_target(out)  # written to a sibling folder and renamed when complete
    return out


def ensure_demo_draft() -> Path:
    """Build (once) and return the demo target's trained EAGLE-3 head."""
    out = cache_root() / "demo" / DEMO_VERSION / "draft"
    if (out / "config.json").is_file():
        return out
    target = ensure_demo_target()
    with _build_lock(out.parent):
        if not (out / "config.json").is_file():
            import shutil

            from tandem.training.demo_pair import build_demo_draft

            log.warning("training the demo EAGLE-3 head in %s (first use only; a few minutes)", out)
            partial = out.with_name("draft.partial")
            build_demo_draft(target, partial, run_dir=out.with_name("draft.run"))
            shutil.rmtree(out, ignore_errors=True)
            partial.rename(out)
    return out
