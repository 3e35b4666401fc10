"""The dtype a checkpoint stores a kind of tensor in, read from the safetensors headers only (no tensor data, no
torch): the eight-byte header length, then the JSON header naming each tensor's dtype."""

from __future__ import annotations

import json
import struct
from pathlib import Path

# safetensors' dtype codes of the float types a scale may be stored in, as torch names them
FLOAT_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
HEADER_MAX_BYTES = 100 << 20  # safetensors' own limit: a larger length is a damaged file, not read into memory


def header(path: Path) -> dict:
    """The JSON header of one safetensors file ({} where the file is not one: the loader names that fault)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(length)) if length <= HEADER_MAX_BYTES else {}
    except (OSError, struct.error, ValueError):
        return {}


def stored_float_dtype(model_dir: str | Path, suffix: str) -> str | None:
    """The float dtype (a torch name) of the first tensor whose name ends with ``suffix``; None where there is
    no such tensor or it is no float."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except ValueError:
            return None
        name = next((n for n in weight_map if n.endswith(suffix)), None)
        shards = [(model_dir / weight_map[name], name)] if name else []
    else:
        shards = [(path, None) for path in sorted(model_dir.glob("*.safetensors"))]
    for path, name in shards:
        entries = header(path)
        name = name or next((n for n in entries if n.endswith(suffix)), None)
        if name in entries:
            return FLOAT_NAMES.get(entries[name].get("dtype"))
    return None
