"""Automatic prefix caching: the pages of the paged caches (MLA rows, indexer keys, and the nextn layer's rows
under MTP) that hold a full page of a request's committed tokens stay shared and reusable by any later request
whose tokens begin alike.

A page's key chains its parent's: key(j) = blake2b(key(j - 1) || token ids of page j), so equal keys mean equal
tokens at every position from 0 to the page's end, and a cached row is only ever reused at the position it was
computed for (rotary embeddings make rows position-specific). With MTP the key also takes the token after the
page: the nextn layer's row at a position is computed from the token that follows it. Keys are pure functions of
the token ids (no salted `hash()`, no clock), so every process of a multi-process run matches alike.

`PrefixCachingAllocator` is the page pool: a free list, a reference count per page (the requests holding it),
the key index, and the cached pages no request holds, least recently released first. Such pages still count as
free: `allocate` takes truly free pages first and evicts cached ones only when none is left.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from ..model.paged_cache import PageAllocator


def chain_key(parent: bytes, tokens) -> bytes:
    """The key of a page whose parent page has key `parent` (b"" for the first page) and whose tokens (with MTP,
    followed by the next token) are `tokens`: 16 bytes of blake2b, the same in every process and run."""
    data = np.asarray(tokens, dtype="<i8").tobytes()
    return hashlib.blake2b(parent + data, digest_size=16).digest()


class PrefixCachingAllocator(PageAllocator):
    """A `PageAllocator` with reference-counted pages and an index of cached full pages by key.

    `allocate` gives pages held once; `acquire` adds a holder to pages found by `match`; `release` drops one
    holder from each page. A page no request holds goes back to the free list, unless it is indexed: then it
    stays cached (`match` finds it) and is evicted, least recently released first, only when `allocate` runs out
    of free pages. `free` counts both. Page 0 (padding) is never handed out.
    """

    def __init__(self, num_pages: int):
        super().__init__(num_pages)
        self._refs = [0] * num_pages  # requests holding each page
        self._page_of: dict[bytes, int] = {}  # key -> cached page
        self._key_of: dict[int, bytes] = {}  # cached page -> key
        # cached pages no request holds, in the order they were released (the first is evicted first)
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evictions = 0

    @property
    def free(self) -> int:
        """Pages `allocate` can hand out: free ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_pages(self) -> int:
        """Pages in the key index (held by requests or not)."""
        return len(self._page_of)

    def refs(self, page: int) -> int:
        """How many requests hold `page`."""
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """`n` pages, each held once: free pages first, then cached pages no request holds, least recently
        released first (their keys leave the index)."""
        if n > self.free:
            raise RuntimeError(f"out of KV cache pages: need {n}, {self.free} free of {self.num_pages}")
        out = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:
                p, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(p)]
                self.evictions += 1
            self._refs[p] = 1
            out.append(p)
        return out

    def release(self, pages) -> None:
        """Drop one holder from each of `pages`. Pages left unheld go back to the free list, or, when cached, to
        the end of the eviction order: a sequence's pages in reverse, so that its last pages are evicted before
        the pages they chain from (which more requests share)."""
        freed = []
        for p in reversed(list(pages)):
            self._refs[p] -= 1
            if self._refs[p] < 0:
                raise RuntimeError(f"page {p} released more often than it was held")
            if self._refs[p] == 0:
                if p in self._key_of:
                    self._evictable[p] = None
                else:
                    freed.append(p)
        self._free.extend(freed)

    def match(self, keys) -> list[int]:
        """The cached pages of the longest prefix of `keys` found in the index (not yet held: see `acquire`)."""
        pages = []
        for k in keys:
            p = self._page_of.get(k)
            if p is None:
                break
            pages.append(p)
        return pages

    def unheld(self, pages) -> int:
        """How many of `pages` no request holds (they count in `free` until acquired)."""
        return sum(1 for p in pages if self._refs[p] == 0)

    def acquire(self, pages) -> None:
        """Add one holder to each of `pages` (cached pages from `match`), taking them out of the eviction order."""
        for p in pages:
            if self._refs[p] == 0:
                del self._evictable[p]
            self._refs[p] += 1

    def insert(self, key: bytes, page: int) -> bool:
        """Index held `page` under `key` (its rows are final: they are never written again). A key already
        indexed keeps its page (this one stays private to its holder); returns whether `page` was indexed."""
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def forget(self, pages) -> None:
        """Take `pages` out of the index (their rows cannot be trusted: a step that wrote them failed)."""
        for p in pages:
            key = self._key_of.pop(p, None)
            if key is None:
                continue
            del self._page_of[key]
            if self._refs[p] == 0:
                del self._evictable[p]
                self._free.append(p)

    def reset(self) -> None:
        """Empty the index: cached pages no request holds become free; held ones stay with their holders."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._page_of.clear()
        self._key_of.clear()
