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
