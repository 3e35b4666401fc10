"""Models named as users name them: a local folder as given, or a Hugging Face id (``org/name``, optionally at
a ``--revision``) resolved through the Hugging Face cache with ``huggingface_hub`` — the cache alone first,
then a download when a network is there (not with ``HF_HUB_OFFLINE=1``) — to the snapshot folder that holds
it. A clear error names the id and the cache when neither has it. A folder whose weights are only
``pytorch_model*.bin`` (many published EAGLE-3 heads) is served from a safetensors copy made once."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from tandem.errors import ConfigError

# What serving reads: configs, weights, the tokenizer, chat templates (not consolidated .pth copies). Published
# EAGLE-3 heads often come as pytorch_model.bin: fetched too, and converted (safetensors_copy).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt", "pytorch_model*.bin"]
IGNORE_PATTERNS = ["original/*"]
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_SNAPSHOT = re.compile(r"/models--([^/]+)--([^/]+)/snapshots/[^/]+/?$")


def resolve_model(name: str, revision: str | None = None, flag: str = "--model", weights: bool = True) -> str:
    """The folder ``name`` names: itself when it is one, else the Hugging Face id's snapshot folder;
    ``flag``: the option that named it, for errors. ``weights``: the caller loads the weights, so a folder
    with only ``pytorch_model*.bin`` files is served from a safetensors copy (``safetensors_copy``)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ConfigError(f"--revision {revision}: {name} is a local folder (a revision names a Hugging Face id's)")
        return safetensors_copy(str(path)) if weights else str(path)
    folder = _from_hub(name, revision, flag)
    return safetensors_copy(folder) if weights else folder


def _from_hub(name: str, revision: str | None, flag: str) -> str:
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
        said = " ".join(str(e).split())  # (one line: the hub's messages span several)
        network = any(w in said for w in ("ConnectError", "Name or service not known", "Connection", "resolve"))
        hint = ("; no network here? give a local folder, or set HF_HUB_OFFLINE=1 with the model in the cache" if network
                else "")
        raise ConfigError(f"{flag} {name}{'@' + revision if revision else ''}: not in the Hugging Face cache {where}, and "
                          f"downloading it failed ({type(e).__name__}: {said[:200]}){hint}") from None


def cache_root() -> Path:
    """Where Tandem keeps what it builds or converts: ``$TANDEM_CACHE``, else ``~/.cache/tandem``."""
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


def hub_id(folder: str) -> str | None:
    """``org/name`` when ``folder`` is a snapshot in a Hugging Face cache, else None."""
    m = _SNAPSHOT.search(str(Path(folder).resolve()))
    return f"{m.group(1)}/{m.group(2)}" if m else None


def safetensors_copy(folder: str) -> str:
    """``folder`` itself when it holds safetensors (or no weights at all); when it holds only
    ``pytorch_model*.bin`` files (as many published EAGLE-3 heads do), a copy beside the Tandem cache with
    those tensors in one ``model.safetensors`` and the other files linked, made once (loaded with
    ``weights_only``: no code in a checkpoint runs)."""
    src = Path(folder)
    bins = sorted(src.glob("pytorch_model*.bin"))
    if not bins or any(src.glob("*.safetensors")):
        return folder

    key = hashlib.sha256("".join(f"{b.resolve()}:{b.stat().st_size}:{b.stat().st_mtime_ns}" for b in bins).encode())
    out = cache_root() / "converted" / f"{src.resolve().name}-{key.hexdigest()[:16]}"
    if (out / "model.safetensors").is_file():
        return str(out)
    import torch
    from tandem.safetensors_file import write_safetensors

    tensors: dict = {}
    for b in bins:
        tensors.update(torch.load(str(b), map_location="cpu", weights_only=True))
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("pytorch_model") and not f.name.startswith("."):
            shutil.copyfile(f, partial / f.name)
    write_safetensors({k: t.contiguous() for k, t in tensors.items()}, partial / "model.safetensors",
              metadata={"format": "pt", "converted_from": ",".join(b.name for b in bins)})
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return str(out)
