"""What a checkpoint folder holds, read from the safetensors headers only (no tensor data, no torch): which file holds
each tensor (the index's weight map, else every shard's header), and the dtype a kind of tensor is stored in. A header
is the eight-byte length, then JSON naming each tensor's dtype, shape and offsets."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from tandem.errors import CheckpointError

# safetensors' dtype codes of the float types a scale may be stored in, as torch names them
FLOAT_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
HEADER_MAX_BYTES = 100 << 20  # safetensors' own limit: a larger length is a damaged file, not read into memory


def header(path: Path) -> dict:
    """The JSON header of one safetensors file; CheckpointError where the file is not one."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > HEADER_MAX_BYTES:
                raise ValueError(f"a header of {length} bytes")
            return json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(f"{path}: not a whole safetensors file ({e}); download it again") from None


def tensor_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it ({} for a folder without any)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {name: folder / fname for name, fname in json.loads(index.read_text()).get("weight_map", {}).items()}
    return {name: path for path in sorted(folder.glob("*.safetensors")) for name in header(path)
            if name != "__metadata__"}


def stored_float_dtype(model_dir: str | Path, suffix: str) -> str | None:
    """The float dtype (a torch name) of the first tensor whose name ends with ``suffix``; None where there is
    no such tensor, it is no float, or the folder cannot be read (the loader names that fault)."""
    try:
        files = tensor_files(model_dir)
        name = next((n for n in files if n.endswith(suffix)), None)
        return FLOAT_NAMES.get(header(files[name]).get(name, {}).get("dtype")) if name else None
    except (CheckpointError, ValueError):
        return None
