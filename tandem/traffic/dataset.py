"""The served-traffic dataset: finished requests' tokens and the target's EAGLE-3 features, on disk.

A folder with ``dataset.json`` (what produced it: target, captured layers, feature width, dtype) and
shards ``shard-000000.safetensors``, ... each holding a few hundred samples:

- ``tokens`` int32 [Σ L]: prompt + output of every sample, back to back;
- ``features`` [Σ (L-1), 3·H]: the captured residual-stream inputs at positions 0..L-2 (the last
  token was never run through the target);
- ``token_offsets``, ``feature_offsets`` int64 [S+1]; ``prompt_lens`` int32 [S];
- metadata ``samples``: JSON list of per-sample facts (temperature, finish reason).

Shards are written whole to a temporary name and renamed, so a reader (the trainer) never sees a
partial one, and a verifier restarted on the same folder appends new shards after the existing ones.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tandem.safetensors_file import write_safetensors

from tandem.errors import ConfigError

FORMAT = "tandem-traffic-v1"
MANIFEST = "dataset.json"


@dataclass(frozen=True)
class TrafficManifest:
    target_model: str
    hidden_size: int
    vocab_size: int
    capture_layers: tuple[int, ...]
    feature_width: int
    dtype: str
    format: str = FORMAT

    @classmethod
    def read(cls, folder: Path) -> "TrafficManifest":
        path = Path(folder) / MANIFEST
        if not path.is_file():
            raise ConfigError(f"{folder}: no {MANIFEST} (is this a folder written by --capture-traffic?)")
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise ConfigError(f"{path}: format {raw.get('format')!r}, this version reads {FORMAT!r}")
        return cls(**{**raw, "capture_layers": tuple(raw["capture_layers"])})

    def write_or_check(self, folder: Path) -> None:
        """A new folder gets this manifest; an existing one must have been written for a target of the
        same shape and captured layers (samples of two targets in one dataset would train a head on a
        mixture). The target's path is recorded but not compared: one model lives at different paths."""
        folder.mkdir(parents=True, exist_ok=True)
        if (folder / MANIFEST).is_file():
            existing = TrafficManifest.read(folder)
            for key in ("hidden_size", "vocab_size", "capture_layers", "feature_width"):
                if getattr(existing, key) != getattr(self, key):
                    raise ConfigError(f"{folder} holds traffic with {key}={getattr(existing, key)}, this target has "
                                      f"{getattr(self, key)}; capture into another folder")
            return
        tmp = folder / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({**asdict(self), "capture_layers": list(self.capture_layers)}, indent=2) + "\n")
        tmp.replace(folder / MANIFEST)


@dataclass(frozen=True)
class TrafficSample:
    tokens: list[int]
    prompt_len: int
    features: torch.Tensor  # [len(tokens) - 1, feature_width], on the host
    info: dict

    @property
    def nbytes(self) -> int:
        return self.features.numel() * self.features.element_size()


def shard_paths(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("shard-*.safetensors"))


def write_shard(folder: Path, index: int, samples: list[TrafficSample]) -> Path:
    tokens = torch.tensor([t for s in samples for t in s.tokens], dtype=torch.int32)
    features = torch.cat([s.features for s in samples])
    token_offsets = torch.tensor([0] + [len(s.tokens) for s in samples]).cumsum(0)
    feature_offsets = torch.tensor([0] + [s.features.shape[0] for s in samples]).cumsum(0)
    prompt_lens = torch.tensor([s.prompt_len for s in samples], dtype=torch.int32)
    path = Path(folder) / f"shard-{index:06d}.safetensors"
    return write_safetensors({"tokens": tokens, "features": features.contiguous(), "token_offsets": token_offsets,
                              "feature_offsets": feature_offsets, "prompt_lens": prompt_lens}, path,
                             metadata={"format": FORMAT, "samples": json.dumps([s.info for s in samples])})


@dataclass(frozen=True)
class TrafficRef:
    """Where one sample lives: (shard file, index in it). Kept in training samples instead of features."""
    shard: str
    index: int


def read_index(folder: Path) -> list[tuple[TrafficRef, list[int], int, dict]]:
    """→ (ref, tokens, prompt_len, info) of every sample in the folder, shard order; features stay on disk."""
    out = []
    for path in shard_paths(folder):
        with safe_open(str(path), framework="pt") as f:
            tokens, offsets = f.get_tensor("tokens").tolist(), f.get_tensor("token_offsets").tolist()
            prompt_lens = f.get_tensor("prompt_lens").tolist()
            infos = json.loads(f.metadata().get("samples", "[]")) or [{}] * len(prompt_lens)
        for i, (plen, info) in enumerate(zip(prompt_lens, infos)):
            out.append((TrafficRef(str(path), i), tokens[offsets[i] : offsets[i + 1]], plen, info))
    return out


def read_features(ref: TrafficRef) -> torch.Tensor:
    """The sample's features [L-1, W], read by slice (the rest of the shard stays on disk)."""
    with safe_open(ref.shard, framework="pt") as f:
        start, end = f.get_slice("feature_offsets")[ref.index : ref.index + 2].tolist()
        return f.get_slice("features")[start:end]
