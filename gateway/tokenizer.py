"""The gateway's tokenizer: tandem's TextTokenizer, whose decode can also keep special tokens
(vLLM's ``skip_special_tokens: false``, and /detokenize, which decodes as transformers does)."""

from __future__ import annotations

from tandem.tokenizer import TextTokenizer


class GatewayTokenizer(TextTokenizer):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decoder(self, skip_special_tokens: bool):
        """A one-argument decode, as the incremental detokenizer takes it."""
        return lambda ids: self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
