"""PagePool: the physical KV pages, their refcounts, generations and prefix hashes.

Modelled on vLLM v1's block_pool: free pages sit in one doubly linked queue in LRU
order (head = evicted next), so a freed page that still carries a prefix hash stays
reusable until it reaches the head and is handed out again. Removal from the middle
(a prefix hit on a cached-free page) is O(1) through the prev/next arrays.

Every hand-out bumps the page's generation: a sequence that remembers the
generation it was given can tell that its page was reused under it
(the free_while_shared failure).
"""
from __future__ import annotations

from typing import Iterable, Sequence

NIL = -1


class NoFreePages(RuntimeError):
    pass


ROOT_HASH = 0x5EED_CAFE      # the parent of a sequence's first page (hash(None) is per-process before 3.12)


def hash_page(parent_hash: int | None, tokens: tuple) -> int:
    """Chained page hash: equal hashes mean equal tokens *and* equal history.

    Python's hash of a tuple of ints is deterministic across processes (no salt),
    which keeps replays reproducible; the first page chains from ROOT_HASH, not from
    None, whose hash varies per process before Python 3.12. Collisions are caught by
    comparing tokens.
    """
    return hash((ROOT_HASH if parent_hash is None else parent_hash, tokens))


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        n = num_pages
        self.ref = [0] * n
        self.generation = [0] * n
        self.page_hash: list[int | None] = [None] * n
        self.page_tokens: list[tuple | None] = [None] * n
        # Where a cached page was computed: its index in the registering sequence and the
        # chained hash of the page before it (None for a first page), so a prefix hit can be
        # checked against the requester's own position and history.
        self.page_index: list[int] = [-1] * n
        self.page_parent: list[int | None] = [None] * n
        self.cached: dict[int, int] = {}          # prefix hash -> page id
        # Free queue as index-linked list: O(1) pop at head, push at tail, unlink anywhere.
        self._prev = list(range(-1, n - 1))
        self._next = list(range(1, n + 1))
        self._next[n - 1] = NIL
        self._head, self._tail = 0, n - 1
        self._is_free = [True] * n
        self.num_free = n
        self.num_cached_free = 0                   # free pages that still carry a hash
        self.num_evictions = 0
        self.observer = None                       # engine hook: observer(kind, pages, **detail)
        self.actor = None                          # request id on whose behalf the pool is called

    # ---- free queue -------------------------------------------------------
    def _unlink(self, p: int) -> None:
        prv, nxt = self._prev[p], self._next[p]
        if prv == NIL:
            self._head = nxt
        else:
            self._next[prv] = nxt
        if nxt == NIL:
            self._tail = prv
        else:
            self._prev[nxt] = prv
        self._prev[p] = self._next[p] = NIL
        self._is_free[p] = False
        self.num_free -= 1
        if self.page_hash[p] is not None:
            self.num_cached_free -= 1

    def free_order(self) -> list[int]:
        """Free pages from next-to-evict to most recently freed (for views and tests)."""
        out, p = [], self._head
        while p != NIL:
            out.append(p)
            p = self._next[p]
        return out

    def is_free(self, p: int) -> bool:
        return self._is_free[p]

    # ---- allocation -------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Hand out n pages from the LRU head; a cached page handed out loses its hash."""
        if n > self.num_free:
            raise NoFreePages(f"asked for {n} pages, {self.num_free} free of {self.num_pages}")
        # Pops from the head, inlined (_unlink for the head case): allocation is the hot path
        # of a simulated production replay (millions of pages).
        pages, evicted = [], []
        nxt, prv, is_free, page_hash, gen, ref = self._next, self._prev, self._is_free, self.page_hash, \
            self.generation, self.ref
        p = self._head
        for _ in range(n):
            q = nxt[p]
            nxt[p] = prv[p] = NIL
            is_free[p] = False
            h = page_hash[p]
            if h is not None:
                evicted.append(p)
                if self.cached.get(h) == p:
                    del self.cached[h]
                page_hash[p] = None
                self.page_tokens[p] = None
                self.page_index[p] = -1
                self.page_parent[p] = None
            gen[p] += 1
            ref[p] = 1
            pages.append(p)
            p = q
        self._head = p
        if p == NIL:
            self._tail = NIL
        else:
            prv[p] = NIL
        self.num_free -= n
        self.num_cached_free -= len(evicted)
        self.num_evictions += len(evicted)
        if self.observer is not None:
            if evicted:
                self.observer("evicted", evicted)
            self.observer("allocated", pages)
        return pages

    def acquire(self, pages: list[int]) -> None:
        """Take one more reference on each page (prefix-cache hits); revives cached-free pages."""
        for p in pages:
            if self._is_free[p]:
                if self.page_hash[p] is None:
                    raise RuntimeError(f"page {p} is free and uncached: it cannot be shared")
                self._unlink(p)
            self.ref[p] += 1
        if self.observer is not None and pages:
            self.observer("shared", pages)

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference per page; pages reaching zero join the free queue's tail.

        Callers pass a sequence's pages tail first, so its last pages (least likely to
        be shared as a prefix) are evicted before its first ones.
        """
        released, still = [], []
        ref, nxt, prv, is_free, page_hash = self.ref, self._next, self._prev, self._is_free, self.page_hash
        tail, cached_free = self._tail, 0
        try:
            for p in pages:
                r = ref[p]
                if r <= 0:
                    raise RuntimeError(f"page {p} freed with refcount {r}")
                ref[p] = r - 1
                if r == 1:                           # onto the free queue's tail, inlined (hot in replays)
                    prv[p], nxt[p] = tail, NIL
                    if tail == NIL:
                        self._head = p
                    else:
                        nxt[tail] = p
                    tail = p
                    is_free[p] = True
                    if page_hash[p] is not None:
                        cached_free += 1
                    released.append(p)
                else:
                    still.append(p)
        finally:                                     # consistent counters even after a bad page
            self._tail = tail
            self.num_free += len(released)
            self.num_cached_free += cached_free
        if self.observer is not None and (released or still):
            self.observer("freed", released, cached=tuple(p for p in released if self.page_hash[p] is not None),
                          still_shared=tuple(still))

    # ---- prefix cache -----------------------------------------------------
    def lookup(self, h: int, tokens: tuple) -> int | None:
        """The page cached under h, only if it holds exactly these tokens."""
        p = self.cached.get(h)
        if p is None or self.page_tokens[p] != tokens:
            return None
        return p

    def register(self, p: int, h: int, tokens: tuple, index: int = -1, parent: int | None = None) -> bool:
        """Mark a full, in-use page as holding the prefix identified by h; True if it was entered.

        index: the page's index in the sequence that computed it; parent: the chained hash
        of the page before it (None for a first page)."""
        if not self.enable_prefix_caching or self.page_hash[p] is not None:
            return False
        if h in self.cached:          # same content computed twice in one batch: keep the first
            return False
        self.cached[h] = p
        self.page_hash[p] = h
        self.page_tokens[p] = tokens
        self.page_index[p] = index
        self.page_parent[p] = parent
        return True

    def notify_registered(self, pages: list[int], indices: list[int]) -> None:
        """Tell the observer which pages register() just entered (one call per sequence and step)."""
        if self.observer is not None and pages:
            self.observer("registered", pages, indices=tuple(indices))

    def forget(self, pages: Iterable[int]) -> list[int]:
        """Drop the prefix hash of these pages (a prefix-cache flush); returns those that had one.

        A free page among them stays free but is no longer reusable as a prefix; the
        observer hears "evicted", so event consumers (time travel, views) stay in step.
        """
        dropped = []
        for p in dict.fromkeys(pages):
            h = self.page_hash[p]
            if h is None:
                continue
            if self.cached.get(h) == p:
                del self.cached[h]
            if self._is_free[p]:
                self.num_cached_free -= 1
            self.page_hash[p] = self.page_tokens[p] = self.page_parent[p] = None
            self.page_index[p] = -1
            dropped.append(p)
        if self.observer is not None and dropped:
            self.observer("evicted", dropped)
        return dropped

    # ---- state ------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def usage(self) -> float:
        """Used / total pages (what the seed write-ups call get_memory_usage)."""
        return self.num_used / self.num_pages

    def refcounts(self) -> Sequence[int]:
        return self.ref
