"""The EAGLE-3 head's per-request state and its prefix cache of the head's own KV pages.

A request may start on a cached prefix (``Eagle3Drafter.attach_prefix``, which also gives the request's first token):
the head's KV entry t depends only on tokens 0..t+1 (through the target's feature at t), so the head keeps a prefix
cache of its own pages, each keyed from the very tokens it was built with (tandem.prefix_cache.draft_page_key), filled
as extends complete pages and when a request is released; a later request whose target KV starts on cached pages takes
the head's pages for the same tokens from there. Entries it does not find (evicted here) are built from zero features
and never cached: drafts from them are worse, never wrong (the target verifies every token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.kv_cache import SequenceKV
from tandem.prefix_cache import PrefixCache, block_keys, draft_page_key


@dataclass
class HeadRequest:
    kv: SequenceKV
    root: int = -1  # last extended token (target id): the next tree's root
    state: torch.Tensor | None = None  # [H] pre-norm output of the last extended row
    top_logp: torch.Tensor | None = None  # float32 [max_topk] log-probs of the root's best children
    top_ids: torch.Tensor | None = None  # int64 [max_topk] their target ids
    # Prefix caching (started by attach_prefix): the sequence's tokens x_0, x_1, ... (entry t pairs x_{t+1}
    # with the target's feature at t), its block keys so far, the pages already offered to the cache, and
    # the pages holding entries built from zero features, which never are.
    tokens: list[int] | None = None
    block_keys: list[bytes] | None = None
    pages_cached: int = 0
    zero_pages: range = range(0)
    # Tokens whose entries attach_prefix found in no cached page: built from zero features right before the request's
    # next extend (Eagle3Drafter._rebuild: requests joining together share forwards).
    rebuild: list[int] = field(default_factory=list)


class HeadPrefixes:
    """The head's prefix cache, keyed by the tokens each page was built with."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.cache = PrefixCache(page_size)

    def _page_keys(self, req: HeadRequest, pages: range) -> list[bytes]:
        """Keys of the request's ``pages`` (each needs the token after its block)."""
        ps = self.page_size
        keys = block_keys(req.tokens, ps, req.block_keys, limit=pages.stop)
        return [draft_page_key(keys[p], req.tokens[(p + 1) * ps]) for p in pages]

    def offer_filled(self, reqs: list[HeadRequest]) -> None:
        """Offer the cache the full pages that extends completed since the last offer (never a page built
        from zero features) of requests started by ``start``."""
        ps = self.page_size
        for req in reqs:
            if req.tokens is None:
                continue
            full = min(req.kv.num_tokens // ps, (len(req.tokens) - 1) // ps)
            if full > req.pages_cached:
                pages = [p for p in range(req.pages_cached, full) if p not in req.zero_pages]
                if pages:
                    keys = self._page_keys(req, range(pages[0], pages[-1] + 1))
                    self.cache.insert([keys[p - pages[0]] for p in pages], [req.kv.pages[p] for p in pages])
                req.pages_cached = full

    def start(self, kv: SequenceKV, tokens: list[int]) -> HeadRequest:
        """A request on ``kv`` (empty) whose ``tokens`` are ``x_0..x_c`` (c: the tokens the target found cached):
        its entries 0..c-1 taken from the cache where found, the rest left to rebuild (``HeadRequest.rebuild``)."""
        ps, cached = self.page_size, len(tokens) - 1
        req = HeadRequest(kv, tokens=list(tokens), block_keys=[])
        req.kv.adopt(self.cache.match(self._page_keys(req, range(cached // ps))))
        req.pages_cached = len(req.kv.pages)
        found = req.kv.num_tokens
        del req.tokens[found + 1 :]  # the next extend adds the rebuilt ones and its own
        self.cache.record(cached, found)
        if found < cached:
            req.zero_pages = range(found // ps, -(-cached // ps))
            req.rebuild = tokens[found + 1 :]
        return req
