"""Text ↔ token ids through a tiktoken BPE file, for models that ship ``tiktoken.model`` and no ``tokenizer.json``
(Kimi-K2, Kimi-K2.5; torch-free).

Such a folder's tokenizer is remote code (``tokenization_kimi.py``, named by ``auto_map`` in
``tokenizer_config.json``) around the ``tiktoken`` package: the BPE ranks from ``tiktoken.model`` (a base64 token and
its rank per line), the pre-tokenizer's split pattern and the number of reserved special ids as class attributes,
the special tokens' names from ``added_tokens_decoder``. That code is never run here: its two attributes are read
from its syntax tree (plain literals, a ``"|".join([...])`` of them), so ``--trust-remote-code`` grants nothing.

Encoding treats special tokens' text as the special tokens (a rendered chat template holds them), as the remote
code's ``encode`` does, adds no BOS (it adds none either), and cuts long texts where the tiktoken package would fail
(long runs of whitespace or of non-whitespace). Decoding skips every special id when asked to.
"""

from __future__ import annotations

import ast
import base64
import json
from pathlib import Path
from typing import Any

from tandem.errors import CheckpointError

TIKTOKEN_FILE = "tiktoken.model"
# tiktoken's Rust core fails on a run of this many characters without a change between whitespace and the rest
# (openai/tiktoken#195), and on very long texts: texts are encoded in pieces within both.
MAX_RUN_CHARS = 25_000
MAX_PIECE_CHARS = 400_000


class TiktokenTokenizer:
    def __init__(self, model_dir: str | Path):
        try:
            import tiktoken
        except ImportError:
            raise CheckpointError(f"{model_dir}: its tokenizer ({TIKTOKEN_FILE}) needs the tiktoken package "
                                  "(pip install tiktoken)") from None
        folder = Path(model_dir)
        config = _tokenizer_config(folder)
        pattern, reserved = _remote_code_attributes(folder, config)
        ranks = _bpe_ranks(folder / TIKTOKEN_FILE)
        names = {int(i): entry.get("content") if isinstance(entry, dict) else str(entry)
                 for i, entry in (config.get("added_tokens_decoder") or {}).items()}
        self.first_special = len(ranks)
        specials = {names.get(i) or f"<|reserved_token_{i}|>": i for i in range(len(ranks), len(ranks) + reserved)}
        self._enc = tiktoken.Encoding(name=folder.name, pat_str=pattern, mergeable_ranks=ranks,
                                      special_tokens=specials)
        self._specials = specials
        self._special_names = {i: name for name, i in specials.items()}

    @staticmethod
    def available(model_dir: str | Path) -> bool:
        return (Path(model_dir) / TIKTOKEN_FILE).is_file()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens`` changes nothing: this tokenizer adds no BOS (as its remote code does not)."""
        ids: list[int] = []
        for piece in _pieces(text):
            ids += self._enc.encode(piece, allowed_special="all")
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Ids outside the tokenizer's vocabulary (a model's padded rows) are dropped, as special ones when asked."""
        top = self.first_special if skip_special_tokens else self._enc.n_vocab
        return self._enc.decode([i for i in ids if 0 <= i < top])

    def longest_token_bytes(self) -> int:
        return max([len(self._enc.decode_single_token_bytes(i)) for i in range(self.first_special)]
                   + [len(name.encode()) for name in self._specials])

    def token_str(self, token_id: int) -> str | None:
        if token_id in self._special_names:
            return self._special_names[token_id]
        try:
            return self._enc.decode_single_token_bytes(token_id).decode("utf-8", "replace")
        except KeyError:
            return None

    def token_id(self, token: str) -> int | None:
        if token in self._specials:
            return self._specials[token]
        try:
            return self._enc.encode_single_token(token.encode())
        except KeyError:
            return None


def _pieces(text: str):
    """``text`` in pieces of at most MAX_PIECE_CHARS, each cut before a run of MAX_RUN_CHARS + 1 characters that are
    all whitespace or all not."""
    if len(text) <= MAX_RUN_CHARS:  # (every prompt but the longest: no walk over its characters)
        yield text
        return
    for start in range(0, len(text), MAX_PIECE_CHARS):
        piece, cut, run, space = text[start : start + MAX_PIECE_CHARS], 0, 0, None
        for i, ch in enumerate(piece):
            if ch.isspace() != space:
                space, run = ch.isspace(), 1
            else:
                run += 1
                if run > MAX_RUN_CHARS:
                    yield piece[cut:i]
                    cut, run = i, 1
        yield piece[cut:]


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / "tokenizer_config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _bpe_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise CheckpointError(f"{path}: line {number} is not a base64 token and its rank") from None
    return ranks


def _remote_code_attributes(folder: Path, config: dict[str, Any]) -> tuple[str, int]:
    """The tokenizer class's ``pat_str`` and its special ids after the BPE ranks, ``num_reserved_special_tokens`` + 2 as
    the Kimi tokenizer counts them, read from the syntax tree of the module ``auto_map`` names."""
    entry = ((config.get("auto_map") or {}).get("AutoTokenizer") or [None])[0]
    module, _, cls = entry.rpartition(".") if entry else ("", "", "")
    candidates = [folder / f"{module}.py"] if module else sorted(folder.glob("tokenization_*.py"))
    source = next((p for p in candidates if p.is_file()), None)
    if source is None:
        raise CheckpointError(f"{folder}: {TIKTOKEN_FILE} without its tokenizer's code (tokenization_*.py, which "
                              "holds the split pattern)")
    found: dict[str, Any] = {}
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.ClassDef) and (not cls or node.name == cls):
            for stmt in node.body:
                target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
                if isinstance(target, ast.Name) and target.id in ("pat_str", "num_reserved_special_tokens"):
                    found[target.id] = _literal(stmt.value)
    pattern, reserved = found.get("pat_str"), found.get("num_reserved_special_tokens")
    if not isinstance(pattern, str) or not isinstance(reserved, int):
        raise CheckpointError(f"{source}: no literal pat_str and num_reserved_special_tokens in class "
                              f"{cls or 'its tokenizer class'} (the code is read, never run)")
    return pattern, reserved + 2


def _literal(node: ast.AST) -> Any:
    """A literal, a ``"sep".join([...literals])`` or a sum of strings; None for anything else."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join" \
            and isinstance(node.func.value, ast.Constant) and len(node.args) == 1 and not node.keywords:
        parts = _literal(node.args[0])
        if isinstance(parts, (list, tuple)) and all(isinstance(p, str) for p in parts):
            return node.func.value.value.join(parts)
        return None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal(node.left), _literal(node.right)
        return left + right if isinstance(left, str) and isinstance(right, str) else None
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None
