"""The Python standard library as a training corpus: the same text on every machine, nothing to download.

Files are split deterministically into training and held-out sets (every ``heldout_every``-th file
of ``tandem.training.stdlib_text.stdlib_sources`` is held out), tokenized with a model folder's ``tokenizer.json``,
and packed into one token stream per split with ``<|bos|>``/``<|eos|>`` around each file. Training
windows are a pure function of (seed, step), so a resumed run sees exactly the batches it would have.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class CorpusConfig:
    limit_bytes: int = 4_000_000  # stdlib_sources limit (the top-level stdlib .py files, ~150 of them)
    heldout_every: int = 10  # file i is held out when i % heldout_every == heldout_every - 1
    recursive: bool = False  # all of Lib/**/*.py but site-packages (~30 MB): the larger GPU variant


def source_files(cfg: CorpusConfig) -> list[Path]:
    from tandem.training.stdlib_text import stdlib_sources

    if not cfg.recursive:
        return stdlib_sources(cfg.limit_bytes)  # the files the demo tokenizer was trained on come first
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        total += path.stat().st_size
        if total > cfg.limit_bytes:
            break
        files.append(path)
    return files


def split_files(cfg: CorpusConfig = CorpusConfig()) -> tuple[list[Path], list[Path]]:
    files = source_files(cfg)
    k = cfg.heldout_every
    train = [f for i, f in enumerate(files) if i % k != k - 1]
    heldout = [f for i, f in enumerate(files) if i % k == k - 1]
    return train, heldout


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def load_tokenizer(model_dir: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def encode_stream(tokenizer, files: list[Path], bos: int | None, eos: int | None) -> torch.Tensor:
    """All files as one int64 stream: [bos] file [eos] [bos] file [eos] ..."""
    encoded = tokenizer.encode_batch([read_text(f) for f in files], add_special_tokens=False)
    ids: list[int] = []
    for enc in encoded:
        ids += ([bos] if bos is not None else []) + enc.ids + ([eos] if eos is not None else [])
    return torch.tensor(ids, dtype=torch.int64)


def train_windows(stream: torch.Tensor, batch: int, length: int, seed: int, step: int) -> torch.Tensor:
    """[batch, length] windows at offsets drawn from (seed, step) alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - length, (batch,), generator=g)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def eval_windows(stream: torch.Tensor, length: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows spread evenly over the stream (a fixed held-out set)."""
    count = min(max_windows, len(stream) // length)
    stride = len(stream) // max(1, count)
    return torch.stack([stream[i * stride : i * stride + length] for i in range(count)])


def sample_prompts(tokenizer, files: list[Path], count: int, max_tokens: int, seed: int,
                   min_tokens: int = 8) -> list[list[int]]:
    """``count`` prompts cut from ``files`` at line starts (so they begin like code does), each the
    tokens of the text from a random line on, cut to a random length in [min_tokens, max_tokens]."""
    rng = random.Random(seed)
    texts = [read_text(f) for f in files]
    weights = [len(t) for t in texts]
    prompts: list[list[int]] = []
    while len(prompts) < count:
        text = rng.choices(texts, weights)[0]
        start = text.rfind("\n", 0, rng.randrange(len(text))) + 1  # a line start
        chunk = text[start : start + 8 * max_tokens]  # comfortably more text than max_tokens tokens
        if not chunk[: chunk.find("\n") + 1 or None].strip():
            continue  # start on a line with code, not a blank one
        ids = tokenizer.encode(chunk, add_special_tokens=False).ids
        if len(ids) < min_tokens:
            continue
        prompts.append(ids[: rng.randint(min_tokens, max_tokens)])
    return prompts
