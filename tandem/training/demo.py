"""The embedded demo model: what ``tandem generate``/``tandem up`` serve when no model is given.

The pair ships inside the package (``tandem/demo_pair``, written by ``scripts/ship_demo_pair.py``): a
byte-level BPE tokenizer trained on the Python standard library's own source (present on every machine),
a small Llama-architecture target *trained* on that source, and its EAGLE-3 head trained on the target's
own continuations of stdlib prompts (recipes in ``tandem.training.demo_pair``), stored in bfloat16. So
the first ``tandem up`` serves at once. ``tandem demo-models --rebuild`` trains the pair again from the
recipes into the cache (``$TANDEM_CACHE`` or ``~/.cache/tandem``; a few minutes each on two CPU cores,
progress on stderr, an interrupted build resumes from its checkpoints); a pair built there is served
instead of the shipped one from then on.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from tandem.model_source import cache_root

log = logging.getLogger("tandem.training.demo")

DEMO_VERSION = "v2-trained"


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


SHIPPED = Path(__file__).resolve().parent.parent / "demo_pair"  # tandem/demo_pair


def _built(kind: str) -> Path:
    return cache_root() / "demo" / DEMO_VERSION / kind


def _use_shipped(rebuild: bool) -> bool:
    """The shipped pair, unless one was built in the cache (or is to be): a target and a head always come
    from the same place, since a head only fits the target it was trained on."""
    return not rebuild and not (_built("target") / "config.json").is_file() and (SHIPPED / "target" / "config.json").is_file()


def ensure_demo_target(rebuild: bool = False) -> Path:
    """The demo target's folder: the shipped one, or one built (once) from the recipe."""
    if _use_shipped(rebuild):
        return SHIPPED / "target"
    out = _built("target")
    if (out / "config.json").is_file():
        return out
    with _build_lock(out.parent):
        if not (out / "config.json").is_file():  # another process may have built it meanwhile
            from tandem.training.demo_pair import build_demo_target

            log.warning("training the demo target in %s (a few minutes)", out)
            build_demo_target(out)  # written to a sibling folder and renamed when complete
    return out


def ensure_demo_draft(rebuild: bool = False) -> Path:
    """The demo target's trained EAGLE-3 head: the shipped one, or one built (once) for the built target."""
    if _use_shipped(rebuild):
        return SHIPPED / "draft"
    out = _built("draft")
    if (out / "config.json").is_file():
        return out
    target = ensure_demo_target(rebuild)
    with _build_lock(out.parent):
        if not (out / "config.json").is_file():
            import shutil

            from tandem.training.demo_pair import build_demo_draft

            log.warning("training the demo EAGLE-3 head in %s (a few minutes)", out)
            partial = out.with_name("draft.partial")
            build_demo_draft(target, partial, run_dir=out.with_name("draft.run"))
            shutil.rmtree(out, ignore_errors=True)
            partial.rename(out)
    return out
