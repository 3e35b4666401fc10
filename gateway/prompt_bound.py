"""A prompt's length checked before it is tokenized: tokenizing megabytes takes seconds of CPU, and
a prompt that cannot fit the context is refused anyway.

No token of the vocabulary decodes to more than ``chars_per_token`` characters (its UTF-8 bytes,
plus one for a leading space a decoder strips), so a text of more than ``context × chars_per_token``
characters has more tokens than the context holds. Doubled for normalizers that shorten text (NFC
composing accents): the bound only refuses what is obviously too long; the exact check follows
tokenization.
"""

from __future__ import annotations

from gateway.errors import bad_request
from tandem.tokenizer import Tokenizer

_NORMALIZER_SLACK = 2


class PromptBound:
    def __init__(self, chars_per_token: int):
        self.chars_per_token = chars_per_token

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> PromptBound:
        return cls((tokenizer.longest_token_bytes() + 1) * _NORMALIZER_SLACK)

    def max_chars(self, max_context: int) -> int | None:
        return max_context * self.chars_per_token if max_context else None

    def check(self, chars: int, max_context: int, param: str) -> None:
        """400 naming ``param`` when ``chars`` characters cannot fit ``max_context`` tokens."""
        limit = self.max_chars(max_context)
        if limit is not None and chars > limit:
            raise bad_request(param, f"the prompt has {chars} characters, more than fit this model's maximum "
                                     f"context length of {max_context} tokens")
