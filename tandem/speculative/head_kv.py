"""How many tokens an EAGLE-3 head's KV cache holds where nothing sets it (one layer a token: small beside the
target's, but a fixed size runs out under load where the target's pool is sized from the GPU)."""

from __future__ import annotations

# The head's KV cache: on CPU, and at least where the GPU has room (Llama-8B-shaped heads in bf16: 4 KiB a token, 256 MiB)
DEFAULT_KV_TOKENS = 65536
HEAD_KV_SHARE_OF_FREE = 0.5  # on a GPU, the most of the memory free once the head is loaded its KV cache takes ...
HEAD_KV_SHARE_OF_TOTAL = 0.05  # ... and, sized by itself (a drafter service), of the GPU's whole memory


def head_kv_tokens(bytes_per_token: int, free: int, total: int | None = None) -> int:
    """Tokens of the head's KV cache a GPU with ``free`` bytes free (``total`` in all, where the head sizes its cache
    by itself) can hold: a share of each, and DEFAULT_KV_TOKENS where that fits in the free share. A drafter service
    starts before its verifier, which counts what the head took as used and sizes its own pool from the rest; one
    restarted beside a running verifier gets a share of what that left."""
    of_free = int(HEAD_KV_SHARE_OF_FREE * free) // bytes_per_token
    room = of_free if total is None else min(of_free, int(HEAD_KV_SHARE_OF_TOTAL * total) // bytes_per_token)
    return max(room, min(DEFAULT_KV_TOKENS, of_free))
