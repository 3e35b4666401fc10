"""Text ↔ token ids through a model folder's ``tokenizer.json`` (HF ``tokenizers``), or its ``tiktoken.model``
(tandem.tiktoken_tokenizer: Kimi-K2 / K2.5); torch-free. ``load_tokenizer`` picks the one the folder has."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tandem.errors import CheckpointError


class Tokenizer(Protocol):
    """What the gateway, ``tandem generate`` and training ask of a tokenizer (TextTokenizer, TiktokenTokenizer)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_id(self, token: str) -> int | None: ...

    def token_str(self, token_id: int) -> str | None:
        """The vocabulary's entry for ``token_id`` (byte-level BPE's spelling, e.g. "Ġhello"), None out of range."""
        ...

    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes one token decodes to, special tokens included (gateway.prompt_bound)."""
        ...


class TextTokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))

    @staticmethod
    def available(model_dir: str | Path) -> bool:
        return (Path(model_dir) / "tokenizer.json").is_file()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens``: the tokenizer's post-processor's (a BOS) around the text, as transformers
        encodes a prompt (the gateway and ``tandem generate`` ask for it); not for a rendered chat template
        (it holds its own) nor for pieces of a text (training data), hence not by default."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """``skip_special_tokens=False``: keep them, as transformers decodes by default (vLLM's
        ``skip_special_tokens: false``, /detokenize)."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_str(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def longest_token_bytes(self) -> int:
        texts = self._tok.decode_batch([[i] for i in range(self._tok.get_vocab_size(with_added_tokens=True))],
                                       skip_special_tokens=False)
        return max((len(t.encode("utf-8", "replace")) for t in texts), default=1)


def tokenizer_available(model_dir: str | Path) -> bool:
    from tandem.tiktoken_tokenizer import TiktokenTokenizer

    return TextTokenizer.available(model_dir) or TiktokenTokenizer.available(model_dir)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The folder's tokenizer: ``tokenizer.json`` first, else ``tiktoken.model``; a CheckpointError naming both."""
    from tandem.tiktoken_tokenizer import TIKTOKEN_FILE, TiktokenTokenizer

    if TextTokenizer.available(model_dir):
        return TextTokenizer(model_dir)
    if TiktokenTokenizer.available(model_dir):
        return TiktokenTokenizer(model_dir)
    raise CheckpointError(f"{model_dir}: no tokenizer (tokenizer.json, or {TIKTOKEN_FILE} with its tokenization_*.py)")
