"""Models named as users name them: a local folder as given, or a Hugging Face id (``org/name``, optionally at
a ``--revision``) resolved through the Hugging Face cache with ``huggingface_hub`` — the cache alone first,
then a download when a network is there (not with ``HF_HUB_OFFLINE=1``) — to the snapshot folder that holds
it. A clear error names the id and the cache when neither has it. Torch-free."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tandem.errors import ConfigError

# What serving reads: configs, safetensors weights, the tokenizer, chat templates (not consolidated .pth copies).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
IGNORE_PATTERNS = ["original/*"]
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_SNAPSHOT = re.compile(r"/models--([^/]+)--([^/]+)/snapshots/[^/]+/?$")


def resolve_model(name: str, revision: str | None = None, flag: str = "--model") -> str:
    """The folder ``name`` names: itself when it is one, else the Hugging Face id's snapshot folder;
    ``flag``: the option that named it, for errors."""
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ConfigError(f"--revision {revision}: {name} is a local folder (a revision names a Hugging Face id's)")
        return str(path)
    if not _HF_ID.match(name) or name.startswith((".", "~")):
        raise ConfigError(f"{flag} {name}: no such folder (nor a Hugging Face id, org/name)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        raise ConfigError(f"{flag} {name}: no such folder; to serve a Hugging Face id install huggingface_hub "
                          "(pip install huggingface_hub)") from None
    where = os.environ.get("HF_HUB_CACHE") or HF_HUB_CACHE
    kwargs = dict(revision=revision, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
    try:
        return snapshot_download(name, local_files_only=True, **kwargs)
    except Exception as cached_error:  # not in the cache (huggingface_hub's own exception types)
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
            raise ConfigError(f"{flag} {name}{'@' + revision if revision else ''}: not in the Hugging Face cache {where} "
                              f"and HF_HUB_OFFLINE is set ({type(cached_error).__name__})") from None
    try:
        return snapshot_download(name, **kwargs)
    except Exception as e:
        raise ConfigError(f"{flag} {name}{'@' + revision if revision else ''}: not in the Hugging Face cache {where}, and "
                          f"downloading it failed ({type(e).__name__}: {str(e)[:200]})") from None


def hub_id(folder: str) -> str | None:
    """``org/name`` when ``folder`` is a snapshot in a Hugging Face cache, else None."""
    m = _SNAPSHOT.search(str(Path(folder).resolve()))
    return f"{m.group(1)}/{m.group(2)}" if m else None
