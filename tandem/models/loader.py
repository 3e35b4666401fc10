"""Load a Hugging Face safetensors checkpoint (single file or sharded with an index) into a model.

Every tensor goes through its module's ``load_weight``, which checks the full shape the config
implies and keeps this rank's shard. Any problem is a one-line CheckpointError naming the file, the
tensor and the shapes. A checkpoint tensor the model has no place for is an error too (a silently
ignored tensor usually means the wrong architecture), except rotary caches some exporters write.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tandem.distributed import tp_group
from tandem.errors import CheckpointError
from tandem.layers.linear import ShapeMismatch

log = logging.getLogger("tandem.loader")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
PROGRESS_EVERY_S = 5.0  # a checkpoint that takes longer to load reports its progress this often (rank 0)


@contextmanager
def default_dtype(dtype: torch.dtype):
    """Modules built inside take ``dtype`` for their parameters (the target's and the head's alike)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextmanager
def open_shard(path: Path):
    """``safe_open`` of one shard, a file that is not whole safetensors (a download cut short, an empty file) a
    CheckpointError naming it."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a whole safetensors file ({e}); download it again") from None


def _get_tensor(f, path: Path, stored: str, model_dir: Path) -> torch.Tensor:
    try:
        return f.get_tensor(stored)
    except SafetensorError:
        raise CheckpointError(f"{model_dir / 'model.safetensors.index.json'}: maps '{stored}' to {path.name}, which does "
                              "not hold it") from None


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise CheckpointError(f"{index}: lists shard {path.name}, which is not in {model_dir}")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{model_dir}: no *.safetensors files (only safetensors checkpoints are supported)")
    files = {}
    for path in shards:
        with open_shard(path) as f:
            files.update({name: path for name in f.keys()})
    return files


def load_checkpoint(
    model: nn.Module,
    model_dir: str | Path,
    packed: dict[str, tuple[str, object]],
    optional: tuple[str, ...] = (),
    ignored: tuple[str, ...] = (),
    rename: Callable[[str], str | None] | None = None,
) -> list[str]:
    """Fill ``model`` from ``model_dir``. ``packed`` maps checkpoint name fragments to fused modules (where
    a layer has no such fused module, the fragment loads into its own);
    ``optional`` lists tensors that may be absent, ``ignored`` tensors skipped if present (e.g.
    ``lm_head.weight`` of a tied checkpoint, which some exporters write anyway). ``rename`` maps a
    checkpoint name to the model's (a wrapper's prefix dropped), or to None for a tensor the model
    deliberately does not use (a vision tower, an MTP layer); those names are returned."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    modules = dict(model.named_modules())
    expected = _expected_tensors(model, packed)
    loaded: set[str] = set()
    skipped: list[str] = []
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    progress = _Progress(model_dir, list(by_file))
    for path, names in by_file.items():
        with open_shard(path) as f:
            for stored in names:
                name = rename(stored) if rename is not None else stored
                if name is None:
                    skipped.append(stored)
                    continue
                if name.endswith(IGNORED_SUFFIXES) or name in ignored:
                    continue
                module_name, param, shard_id = _locate(name, packed, modules)
                module = modules.get(module_name)
                if module is None or not hasattr(module, "load_weight") or getattr(module, param, None) is None:
                    raise CheckpointError(f"{path.name}: unexpected tensor '{stored}' ({_unexpected(module, param)})")
                tensor = _get_tensor(f, path, stored, model_dir)
                try:
                    module.load_weight(param, tensor, shard_id)
                except ShapeMismatch as e:
                    raise CheckpointError(f"{path.name}: tensor '{stored}' {e}") from None
                loaded.add(name)
        progress.file_done(path)
    missing = sorted(set(expected) - loaded - set(optional))
    if missing:
        raise CheckpointError(
            f"{model_dir}: missing tensor '{missing[0]}'"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return skipped


class _Progress:
    """Rank 0's log of a long load: files and bytes read so far, every PROGRESS_EVERY_S (a Kimi-K2.5 checkpoint is
    64 files, ~594 GB, minutes to read; nothing is logged for a load shorter than that)."""

    def __init__(self, model_dir: Path, paths: list[Path]):
        self.model_dir, self.files = model_dir, len(paths)
        self.total = sum(path.stat().st_size for path in paths)
        self.done_files, self.done_bytes = 0, 0
        self.started = self.last = time.monotonic()
        self.quiet = not tp_group().is_leader

    def file_done(self, path: Path) -> None:
        self.done_files += 1
        self.done_bytes += path.stat().st_size
        now = time.monotonic()
        if self.quiet or now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        log.info("loading %s: %d of %d files (%.1f of %.1f GB) in %.0f s", self.model_dir.name, self.done_files,
                 self.files, self.done_bytes / 1e9, self.total / 1e9, now - self.started)


def _locate(name: str, packed: dict[str, tuple[str, object]],
            modules: dict[str, nn.Module]) -> tuple[str, str, object]:
    module_name, _, param = name.rpartition(".")
    head, _, leaf = module_name.rpartition(".")
    if leaf in packed:
        fused, shard_id = packed[leaf]
        fused_name = f"{head}.{fused}" if head else fused
        if fused_name in modules:  # else this layer keeps the part as its own module (formats that cannot fuse)
            return fused_name, param, shard_id
    return module_name, param, None


def _unexpected(module: nn.Module | None, param: str) -> str:
    """Why a checkpoint tensor has no place in the model: a layer the config quantizes stored plain, or quantized parts
    where it quantizes nothing, named as such (else no such weight)."""
    if module is not None and hasattr(module, "load_weight"):
        held = [name for name, _ in module.named_parameters(recurse=False) if name != "bias"]
        if getattr(module, "quant", None) is not None:
            return (f"stored unquantized, but the config's quantization_config quantizes this layer: expected "
                    f"{', '.join(held)}")
        if param.startswith("weight_") or param == "input_scale":
            return (f"a quantized part, but the config's quantization_config does not quantize this layer "
                    f"({', '.join(held)})")
    return "no such weight in this architecture"


def _expected_tensors(model: nn.Module, packed: dict[str, tuple[str, object]]) -> list[str]:
    """Checkpoint tensor names the model needs, unfolding fused modules into their parts."""
    fused_parts: dict[str, list[str]] = {}
    for part, (fused, _) in packed.items():
        fused_parts.setdefault(fused, []).append(part)
    names = []
    seen: set[int] = set()
    for full_name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied weights are stored once
            continue
        seen.add(id(p))
        module_name, _, param = full_name.rpartition(".")
        head, _, leaf = module_name.rpartition(".")
        for part in fused_parts.get(leaf, [leaf]):
            names.append(f"{head}.{part}.{param}" if head else f"{part}.{param}")
    return names


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(requested: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` means the checkpoint's dtype on GPU and float32 on CPU (bf16/fp16 matmuls are slow there)."""
    if requested == "auto":
        return DTYPES.get(checkpoint_dtype, torch.float32) if device.type == "cuda" else torch.float32
    if requested not in DTYPES:
        raise CheckpointError(f"unknown dtype '{requested}'; choose auto, {', '.join(DTYPES)}")
    return DTYPES[requested]
