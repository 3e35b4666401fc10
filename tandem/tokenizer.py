"""Text ↔ token ids through a model folder's ``tokenizer.json`` (HF ``tokenizers``; torch-free)."""

from __future__ import annotations

from pathlib import Path

from tandem.errors import CheckpointError


class TextTokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no tokenizer.json; pass token ids instead (--prompt-token-ids)")
        self._tok = Tokenizer.from_file(str(path))

    @staticmethod
    def available(model_dir: str | Path) -> bool:
        return (Path(model_dir) / "tokenizer.json").is_file()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As transformers encodes: with the tokenizer's special tokens (its post-processor's BOS) unless
        told otherwise (a rendered chat template already holds its own)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
