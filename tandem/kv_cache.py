"""The paged KV cache: one preallocated pool of fixed-size pages, and the allocator that hands them out.

Pages are the unit of memory; a sequence's KV lives in the pages its block table lists, in order, so
token ``t`` of a sequence sits at ``block_table[t // page_size]``, offset ``t % page_size``. Only
rank 0 allocates (it owns the scheduler); other ranks receive block tables and hold an identically
shaped pool of their own heads. Page 0 is reserved as the dummy page that padded slots of CUDA-graph
batches write into, so it is never handed out.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.errors import OutOfPagesError

if TYPE_CHECKING:
    from tandem.prefix_cache import PrefixCache

DUMMY_PAGE = 0


def page_slots(block_tables: torch.Tensor, index: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat pool slots of KV indices ``index`` (int64 [B, n]) through each row's block table (int32
    [B, max_pages]) → int64 [B, n], on the device: for static inputs that advance there (CUDA graphs).
    The gather reads only the pages it needs; the table is never widened as a whole."""
    return block_tables.gather(1, index // page_size).long() * page_size + index % page_size


@dataclass(frozen=True)
class KVSpec:
    """What one token stores per layer on this rank, as the model declares it (``kv_spec()``):
    ``entries`` tensors of ``[heads, dim]`` — 2 (K and V) for dense attention, 1 for MLA's latent
    (normalised c_kv and rotated k_pe, shared by all heads)."""

    entries: int
    heads: int
    dim: int


class KVPool:
    """Per-layer K and V pages: ``k[layer]`` is ``[num_pages, page_size, local_kv_heads, head_dim]``.
    With ``entries=1`` (MLA) a layer has one latent pool and ``layer(i)`` returns ``(latent, None)``."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, entries: int = 2):
        shape = (entries, num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages, self.page_size = num_pages, page_size

    @classmethod
    def from_spec(cls, spec: KVSpec, num_layers: int, num_pages: int, page_size: int, dtype: torch.dtype,
                  device: torch.device) -> "KVPool":
        return cls(num_layers, num_pages, page_size, spec.heads, spec.dim, dtype, device, entries=spec.entries)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.data[0, i], (self.data[1, i] if self.data.shape[0] == 2 else None)

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the KV of flat slots ``src`` to ``dst`` in every layer (compacting accepted tree nodes)."""
        if not src:
            return
        flat = self.data.view(*self.data.shape[:2], -1, *self.data.shape[-2:])  # [entries, L, slots, H, D]
        index = torch.tensor(src, device=self.data.device)
        moved = flat.index_select(2, index)  # a copy, so overlapping src/dst are safe
        flat.index_copy_(2, torch.tensor(dst, device=self.data.device), moved)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       entries: int = 2) -> int:
        return entries * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class PageAllocator:
    """Free-list of page ids. ``shuffle_seed`` scatters the order pages are handed out (for tests).

    With a ``cache`` (tandem.prefix_cache.PrefixCache), freeing a cached page drops a reference instead,
    cached pages nobody holds count as free, and allocation evicts them (least recent first) before failing."""

    def __init__(self, num_pages: int, page_size: int, shuffle_seed: int | None = None,
                 cache: "PrefixCache | None" = None):
        if num_pages < 2:
            raise OutOfPagesError(f"the KV cache needs at least 2 pages (one is reserved), got {num_pages}")
        ids = list(range(1, num_pages))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(ids)
        self._free = deque(ids)
        self.num_pages, self.page_size = num_pages, page_size
        self.cache = cache

    @property
    def num_free(self) -> int:
        """Pages an allocation can get now: free ones and cached ones nobody holds."""
        return len(self._free) + (self.cache.num_evictable if self.cache is not None else 0)

    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free) and self.cache is not None:
            self._free.extend(self.cache.evict(n - len(self._free)))
        if n > len(self._free):
            raise OutOfPagesError(
                f"KV cache out of pages: need {n}, {len(self._free)} free of {self.capacity_pages} "
                f"(page size {self.page_size} tokens); shorten requests, lower the batch, or give the cache more memory"
            )
        return [self._free.popleft() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        """Give back a sequence's pages (cached ones lose a reference and stay cached)."""
        self._free.extend(self.cache.release(pages) if self.cache is not None else pages)


@dataclass
class SequenceKV:
    """A sequence's pages and how many of its tokens are committed to them.

    ``pages`` is the block table as a list; an int32 array mirrors it (``page_table``), kept in step as
    pages come and go, because every forward stages each sequence's whole block table: from a list
    that is a Python-int conversion per page (slow at large batches of long sequences), from the array
    a memcpy."""

    allocator: PageAllocator
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    _table: np.ndarray = field(default_factory=lambda: np.zeros(16, dtype=np.int32), init=False, repr=False,
                               compare=False)  # change ``pages`` only through reserve/truncate, which keep it

    def __post_init__(self) -> None:
        if self.pages:  # built with pages already (tests)
            self._table = np.array(self.pages, dtype=np.int32)

    def adopt(self, pages: list[int]) -> None:
        """Start an empty sequence on cached ``pages`` (the caller took a reference on each): their tokens
        count as committed."""
        if self.pages:
            raise ValueError("adopt needs an empty sequence")
        self.pages = []
        self._table = np.zeros(max(16, len(pages)), dtype=np.int32)
        self._table[: len(pages)] = pages
        self.pages.extend(pages)
        self.num_tokens = len(pages) * self.allocator.page_size

    @property
    def full_pages(self) -> list[int]:
        """The pages every token of which is committed (what a prefix cache may keep)."""
        return self.pages[: self.num_tokens // self.allocator.page_size]

    def pages_needed(self, total_tokens: int) -> int:
        return max(0, self.allocator.pages_for(total_tokens) - len(self.pages))

    def reserve(self, total_tokens: int) -> None:
        """Make room for ``total_tokens`` tokens in all (allocating pages as needed)."""
        new = self.allocator.allocate(self.pages_needed(total_tokens))
        if not new:
            return
        start, end = len(self.pages), len(self.pages) + len(new)
        if end > len(self._table):  # grow geometrically: amortised O(1) per page
            grown = np.zeros(max(end, 2 * len(self._table)), dtype=np.int32)
            grown[:start] = self._table[:start]
            self._table = grown
        self._table[start:end] = new
        self.pages.extend(new)

    def page_table(self, copy: bool = True) -> np.ndarray:
        """The block table as int32. ``copy=False``: a view, valid until the next reserve or truncate
        (for staging it at once)."""
        view = self._table[: len(self.pages)]
        return view.copy() if copy else view

    def truncate(self, num_tokens: int) -> None:
        """Keep ``num_tokens`` committed tokens and give back the pages beyond them."""
        keep = self.allocator.pages_for(num_tokens)
        self.allocator.free(self.pages[keep:])
        del self.pages[keep:]
        self.num_tokens = num_tokens

    def commit(self, num_tokens: int) -> None:
        """Mark ``num_tokens`` tokens committed and keep every page reserved past them: work queued
        further on the device (the next run of rounds) still writes into those pages."""
        if self.allocator.pages_for(num_tokens) > len(self.pages):
            raise ValueError(f"cannot commit {num_tokens} tokens to {len(self.pages)} pages")
        self.num_tokens = num_tokens

    def release(self) -> None:
        self.truncate(0)

    def slot(self, token_index: int) -> int:
        ps = self.allocator.page_size
        return self.pages[token_index // ps] * ps + token_index % ps
