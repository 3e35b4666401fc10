"""The prefix cache: full KV pages shared between sequences by content, reference-counted, LRU-evicted.

A page is keyed by a chained hash of the page-aligned token blocks up to and including its own
(``block_keys``), so one key names the page's whole prefix: two sequences with the same key hold the
same KV in that page. Only full pages whose tokens are all committed are cached; a cached page is never
written again (a sequence writes only past its committed tokens, and every page it shares lies strictly
before them), so sharing needs no copy-on-write.

A page is in exactly one of three states: free (the allocator's list), owned by one sequence and not
cached, or cached (in the index, with a reference count of the sequences holding it). A cached page
nobody holds stays until the allocator needs it: allocation evicts the least recently released ones
first. Keys are 128-bit BLAKE2b digests, so a client cannot craft another client's key. A request's cache salt (vLLM's
``cache_salt``) starts its chain, so only requests of the same salt share pages: a tenant cannot time another's
prompts through the cache.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

KEY_BYTES = 16


def block_keys(tokens: list[int], page_size: int, known: list[bytes] | None = None,
               limit: int | None = None, salt: str = "") -> list[bytes]:
    """Chained keys of every full ``page_size`` block of ``tokens`` (of the first ``limit`` blocks at most);
    ``known``: keys already computed for a prefix of the same tokens (extended in place and returned); ``salt``: the
    request's cache salt ("" for none), the chain's start."""
    keys = known if known is not None else []
    prev = keys[-1] if keys else _salt_root(salt)
    blocks = len(tokens) // page_size if limit is None else min(limit, len(tokens) // page_size)
    for b in range(len(keys), blocks):
        block = np.asarray(tokens[b * page_size : (b + 1) * page_size], dtype=np.int64).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


def _salt_root(salt: str) -> bytes:
    """The start of a salted chain (b"" without a salt: the keys an unsalted request always had)."""
    return hashlib.blake2b(b"cache-salt:" + salt.encode(), digest_size=KEY_BYTES).digest() if salt else b""


def draft_page_key(block_key: bytes, next_token: int) -> bytes:
    """The key of an EAGLE-3 head's page. The head's KV entry t is built from (token t+1, the target's
    feature at t), so its page p also depends on the token after block p: block p's key with that token."""
    return hashlib.blake2b(block_key + int(next_token).to_bytes(8, "little", signed=True),
                           digest_size=KEY_BYTES).digest()


@dataclass
class PrefixCacheStats:
    """Counts since start (metrics read differences): tokens asked for and found, pages evicted."""
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached
    evictions: int = 0  # cached pages given back to the free list


class PrefixCache:
    """The index of cached pages; a PageAllocator consults it to free and evict (``PageAllocator.cache``)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}  # cached page -> sequences holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, least recent first
        self.stats = PrefixCacheStats()

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._idle)

    def holds(self, page: int) -> bool:
        return page in self._key_of

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    def match(self, keys: list[bytes]) -> list[int]:
        """The pages of the longest run of ``keys`` cached from the first, each with a reference taken for
        the caller."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            self._take(page)
            pages.append(page)
        return pages

    def record(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count a lookup that a prompt went on with (one that had to wait is counted when it goes)."""
        self.stats.queries += queried_tokens
        self.stats.hits += hit_tokens

    def insert(self, keys: list[bytes], pages: list[int]) -> None:
        """Cache a sequence's full committed pages (``keys[i]`` names ``pages[i]``); the sequence keeps its
        references. A key already cached under another page keeps that page (this one stays the sequence's)."""
        for key, page in zip(keys, pages):
            if page in self._key_of or key in self._page_of:
                continue
            self._page_of[key], self._key_of[page], self._refs[page] = page, key, 1

    def release(self, pages: list[int]) -> list[int]:
        """Drop one reference to each page → the pages that are not cached (the caller frees them). Later
        pages of a sequence become evictable before earlier ones (they are released in reverse), so a chain
        is evicted from its tail and a cached prefix stays usable as long as possible."""
        uncached = []
        for page in reversed(pages):
            refs = self._refs.get(page)
            if refs is None:
                uncached.append(page)
                continue
            if refs <= 0:
                raise RuntimeError(f"page {page} released more often than taken")
            self._refs[page] = refs - 1
            if refs == 1:
                self._idle[page] = None
        uncached.reverse()
        return uncached

    def evict(self, n: int) -> list[int]:
        """Forget up to ``n`` cached pages nobody holds, least recently released first → their ids."""
        out = []
        while len(out) < n and self._idle:
            page, _ = self._idle.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            del self._refs[page]
            out.append(page)
        self.stats.evictions += len(out)
        return out

    def _take(self, page: int) -> None:
        self._refs[page] += 1
        self._idle.pop(page, None)
