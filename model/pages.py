"""The host side of the paged KV cache: which page holds what, who holds it, and the prefix cache.

The device holds one pool of `n_pages` pages of `page_size` cells (model/kvcache.py); a sequence's
block table lists its pages in order, so its position p lives in cell p % page_size of page
`table[p // page_size]`. This module hands pages out and takes them back, with a reference count
per page, and keeps vLLM's automatic prefix cache:

- a page that is full is keyed by `chain_digest`: the sha256 of the previous page's key and its own
  tokens, so a key names every token from the start of the sequence to the page's end (the KV of a
  cell depends on all of them). sha256, not Python's hash: tuple hashes of ints collide on purpose
  with little effort, and a collision would serve another prompt's KV;
- a new sequence takes the longest chain of cached pages its tokens share (`match`), from any earlier
  sequence, running or finished, and computes only the rest;
- a page nobody holds goes back to the free list, or, when it is keyed, to the cached list, kept in
  least-recently-used order: `take` hands out never-keyed free pages first, then evicts the least
  recently used cached page (forgetting its key). So cached prefixes cost nothing until the pool
  needs the room.

Shared pages are always full and never written again: a sequence writes only past its cached prefix,
in pages of its own. No jax here; the scheduler (model/scheduler.py) drives it.

A watcher (`watch`, `PageEvents`) hears each key as it is made, evicted or forgotten, and a clear: vLLM's KV
cache events (model/kv_events.py publishes them), called on the engine thread that owns the pool.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol

import numpy as np

ROOT_DIGEST = b""  # the key before the first page


def chain_digest(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full page holding `tokens`, after the page keyed `previous`."""
    return hashlib.sha256(previous + np.asarray(tokens, "<i4").tobytes()).digest()


def page_digests(tokens: Sequence[int], page_size: int, previous: bytes = ROOT_DIGEST) -> list[bytes]:
    """The keys of every full page of `tokens`, in order."""
    out = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        previous = chain_digest(previous, tokens[start:start + page_size])
        out.append(previous)
    return out


class PageEvents(Protocol):
    """What the prefix cache keys and forgets, as it happens (vLLM's BlockStored, BlockRemoved and
    AllBlocksCleared). Called on the engine thread: it must never block."""

    def stored(self, digest: bytes, parent: bytes, tokens: Sequence[int]) -> None:
        """A full page keyed `digest` = chain_digest(parent, tokens) is cached (parent ROOT_DIGEST: the first)."""

    def removed(self, digests: Sequence[bytes]) -> None:
        """These keys are no longer cached (evicted for room, or forgotten)."""

    def cleared(self) -> None:
        """Nothing is cached (a new pool, or one cleared after a failed iteration)."""


class PagePool:
    """Reference-counted pages with a prefix cache; `n_pages` fixed at start."""

    events: PageEvents | None = None  # `watch`

    def __init__(self, n_pages: int, page_size: int):
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs pages and cells: {n_pages} pages of {page_size}")
        self.n_pages = n_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(n_pages))  # held by nobody, keyed by nothing
        self._cached: OrderedDict[int, None] = OrderedDict()  # held by nobody, keyed: LRU first
        self._refs = [0] * n_pages
        self._key: list[bytes | None] = [None] * n_pages
        self._by_key: dict[bytes, int] = {}
        self.queries_tokens = 0  # tokens looked up by `match` (vLLM's prefix_cache_queries)
        self.hits_tokens = 0  # of those, tokens found in cached pages

    # --- counts ------------------------------------------------------------------------------------

    def available(self) -> int:
        """Pages `take` can hand out now (free, or cached and evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        """Pages some sequence holds."""
        return self.n_pages - self.available()

    @property
    def cached(self) -> int:
        """Pages nobody holds that still hold a cached prefix."""
        return len(self._cached)

    # --- pages -------------------------------------------------------------------------------------

    def take(self, n: int) -> list[int] | None:
        """`n` pages for a sequence's own writes (reference 1 each), or None when fewer are available
        (nothing taken)."""
        if n > self.available():
            return None
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=False)  # the least recently used prefix goes
                del self._by_key[self._key[page]]
                if self.events is not None:
                    self.events.removed([self._key[page]])
                self._key[page] = None
            self._refs[page] = 1
            out.append(page)
        return out

    def release(self, pages: Sequence[int]) -> None:
        """A sequence lets go of its pages; the keyed ones stay cached, the others are free."""
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] < 0:
                raise AssertionError(f"page {page} released more often than it was taken")
            if self._refs[page] == 0:
                if self._key[page] is not None:
                    self._cached[page] = None  # most recently used: evicted last
                else:
                    self._free.append(page)

    # --- the prefix cache --------------------------------------------------------------------------

    def match(self, digests: Sequence[bytes], n_tokens: int) -> list[int]:
        """The cached pages of the longest chain of `digests` (a prompt's full pages, in order), each
        now held once more by the caller. `n_tokens`: the prompt's length, for the hit rate."""
        pages = self.hold(digests)
        self.queries_tokens += n_tokens
        self.hits_tokens += len(pages) * self.page_size
        return pages

    def hold(self, digests: Sequence[bytes]) -> list[int]:
        """`match` without counting a query: the cached pages of the longest chain of `digests`, each
        now held once more by the caller (a slot file being written)."""
        pages = []
        for digest in digests:
            page = self._by_key.get(digest)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self._refs[page] == 0:
                del self._cached[page]
            self._refs[page] += 1
        return pages

    def cached_chain(self, digests: Sequence[bytes]) -> int:
        """How many of `digests`, from the first, are cached now (nothing taken, nothing counted)."""
        n = 0
        while n < len(digests) and digests[n] in self._by_key:
            n += 1
        return n

    def unmatch(self, pages: Sequence[int], n_tokens: int) -> None:
        """Undo a `match` whose sequence could not be admitted after all (it will look again)."""
        self.release(pages)
        self.queries_tokens -= n_tokens
        self.hits_tokens -= len(pages) * self.page_size

    def publish(self, page: int, digest: bytes, tokens: Sequence[int] = (), parent: bytes = ROOT_DIGEST) -> None:
        """Key a page that just filled up, so later sequences can share it. A page whose tokens are
        already cached elsewhere (two sequences computed the same prefix at once) stays unkeyed.
        `tokens` and `parent` (digest = chain_digest(parent, tokens)) are for the watcher."""
        if self._key[page] is None and digest not in self._by_key:
            self._key[page] = digest
            self._by_key[digest] = page
            if self.events is not None:
                self.events.stored(digest, parent, tokens)

    def forget(self, digests: Sequence[bytes]) -> int:
        """Drop the keys of `digests` from the prefix cache (a slot erased): a page nobody holds is free
        again, a held one stays with its holder, unshared from now on. Returns the pages forgotten."""
        gone = []
        for digest in digests:
            page = self._by_key.pop(digest, None)
            if page is None:
                continue
            self._key[page] = None
            if self._refs[page] == 0:
                del self._cached[page]
                self._free.append(page)
            gone.append(digest)
        if gone and self.events is not None:
            self.events.removed(gone)
        return len(gone)

    def clear(self) -> None:
        """Forget everything: every page free, no prefix cached (after a failed iteration). The
        query and hit counts go on (they are cumulative)."""
        counts = self.queries_tokens, self.hits_tokens
        self.__init__(self.n_pages, self.page_size)
        self.queries_tokens, self.hits_tokens = counts
        if self.events is not None:
            self.events.cleared()

    def watch(self, events: PageEvents) -> None:
        """From now on, tell `events` what the prefix cache keys and forgets; it first hears a clear, so
        a subscriber drops what an earlier pool (a model loaded again) had told it."""
        self.events = events
        events.cleared()
