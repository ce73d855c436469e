"""PagePool: the physical KV pages, their refcounts, generations and prefix hashes.

Modelled on vLLM v1's block_pool: free pages sit in one doubly linked queue in LRU
order (head = evicted next), so a freed page that still carries a prefix hash stays
reusable until it reaches the head and is handed out again. Removal from the middle
(a prefix hit on a cached-free page) is O(1) through the prev/next arrays.

Every hand-out bumps the page's generation: a sequence that remembers the
generation it was given can tell that its page was reused under it
(the free_while_shared failure).

The per-page loops (hand-out, free, registration, the prefix walk, chained hashes) are
plain functions over these lists in pool_ops.py, compiled from csrc/pool_ops.c when a C
compiler is at hand (a simulated production replay runs millions of pages through them),
their Python reference otherwise; the lists stay the one representation everyone reads.

Every call that changes who holds a page names its owner explicitly: a request id, or
a named reservation (a string, as the pool_pressure fault takes pages for no request).
Each change is reported to `observer` (when one is set) in the vocabulary of the
events it becomes: `observer(event_type, *fields)`, the event's own fields after
`step` and `t_ns`, which the listener supplies (the engine, the simulator). So the
pool's changes map to event types in one place, here; POOL_EVENTS lists them.
"""
from __future__ import annotations

from array import array
from typing import Hashable, Iterable, NamedTuple, Sequence

from ..events import PagesAllocated, PagesEvicted, PagesFreed, PagesRegistered, PagesShared
from . import pool_ops


class FreeQueueView(NamedTuple):
    """The pool's free queue as stored (read-only views; NIL = -1 ends a chain)."""
    is_free: memoryview           # per page: 1 on the queue
    head: int                     # next to evict, or NIL
    next: memoryview              # per page: the page after it on the queue
    prev: memoryview              # per page: the page before it

NIL = -1

# What the pool reports, in the order of a page's life: observer(PagesAllocated, pages, generations, owner),
# (PagesShared, pages, owner), (PagesRegistered, pages, page_indices, owner), (PagesFreed, pages, owner,
# cached, still_shared), (PagesEvicted, pages).
POOL_EVENTS: tuple[type, ...] = (PagesAllocated, PagesShared, PagesRegistered, PagesFreed, PagesEvicted)

Owner = Hashable          # a request id (int) or a named reservation (str); None: nobody in particular


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


def hash_chain(parent_hash: int | None, blocks: list[tuple]) -> list[tuple[int, tuple]]:
    """(hash, block) for consecutive pages after parent_hash: hash_page chained along, in one call
    (compiled with the pool's loops when they load)."""
    return pool_ops.active().hash_chain(ROOT_HASH, parent_hash, blocks)


class PagePool:
    # Fault seams: `free` (a free that ignores the refcount: free_while_shared);
    # `allocate_with_generations` (a hand-out that keeps an evicted page's index entry:
    # eviction_keeps_index_entry).
    FAULT_SEAMS = frozenset({"free", "allocate_with_generations"})

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, ops: str = "auto"):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        n = num_pages
        # Per-page integers in typed arrays (indexable like lists, np.asarray() without a copy);
        # per-page objects (hashes, tokens) in lists.
        self.ref = array("q", bytes(8 * n))
        self.generation = array("q", bytes(8 * n))
        self.page_hash: list[int | None] = [None] * n
        self.page_tokens: list[tuple | None] = [None] * n
        # Where a cached page was computed: its index in the registering sequence and the
        # chained hash of the page before it (None for a first page), so a prefix hit can be
        # checked against the requester's own position and history.
        self.page_index = array("q", [-1]) * n
        self.page_parent: list[int | None] = [None] * n
        self.cached: dict[int, int] = {}          # prefix hash -> page id
        # Free queue as index-linked list: O(1) pop at head, push at tail, unlink anywhere.
        self._prev = array("q", range(-1, n - 1))
        self._next = array("q", range(1, n + 1))
        self._next[n - 1] = NIL
        self._head, self._tail = 0, n - 1
        self._is_free = array("b", b"\x01" * n)
        self.num_free = n
        self.num_cached_free = 0                   # free pages that still carry a hash
        self.num_evictions = 0
        self.observer = None                       # observer(event_type, *fields): see the module doc
        self._ids = list(range(n))                 # one int object per page id, shared by every list of pages
        self._ops = pool_ops.active(ops)           # the per-page loops: compiled, or their Python reference

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
        return self._is_free[p] == 1

    def count_free(self, pages: Iterable[int]) -> int:
        """How many of these pages are on the free queue."""
        return self._ops.count_free(self._is_free, pages if type(pages) is list else list(pages))

    # ---- allocation -------------------------------------------------------
    def allocate(self, n: int, owner: Owner) -> list[int]:
        """Hand out n pages to owner from the LRU head; a cached page handed out loses its hash."""
        return self.allocate_with_generations(n, owner)[0]

    def allocate_with_generations(self, n: int, owner: Owner) -> tuple[list[int], list[int]]:
        """allocate(), and each page's new generation (what a sequence records to detect reuse:
        the ints the hand-out made, not a second read of the array)."""
        if n > self.num_free:
            raise NoFreePages(f"asked for {n} pages, {self.num_free} free of {self.num_pages}")
        pages, gens, evicted, head = self._ops.take(self._next, self._prev, self._is_free, self.page_hash,
                                                    self.page_tokens, self.page_index, self.page_parent,
                                                    self.generation, self.ref, self.cached, self._ids, self._head, n)
        self._head = head
        if head == NIL:
            self._tail = NIL
        self.num_free -= n
        if evicted:
            self.num_cached_free -= len(evicted)
            self.num_evictions += len(evicted)
        obs = self.observer
        if obs is not None:
            if evicted:
                obs(PagesEvicted, tuple(evicted))
            obs(PagesAllocated, tuple(pages), tuple(gens), owner)
        return pages, gens

    def acquire(self, pages: list[int], owner: Owner) -> None:
        """Take one more reference on each page for owner (prefix-cache hits); revives cached-free pages."""
        ref, is_free = self.ref, self._is_free
        for p in pages:
            if is_free[p]:
                if self.page_hash[p] is None:
                    raise RuntimeError(f"page {p} is free and uncached: it cannot be shared")
                self._unlink(p)
            ref[p] += 1
        if self.observer is not None and pages:
            self.observer(PagesShared, tuple(pages), owner)

    def free(self, pages: Iterable[int], owner: Owner) -> None:
        """Drop owner's reference on each page; pages reaching zero join the free queue's tail.

        Callers pass a sequence's pages tail first, so its last pages (least likely to
        be shared as a prefix) are evicted before its first ones. A page with no reference
        left raises RuntimeError, after the pages before it were freed and counted.
        """
        released, still, cached, self._head, self._tail, error = self._ops.release(
            self.ref, self._next, self._prev, self._is_free, self.page_hash, pages, self._head, self._tail)
        self.num_free += len(released)
        self.num_cached_free += len(cached)
        if error is not None:
            raise error
        if self.observer is not None and (released or still):
            self.observer(PagesFreed, tuple(released), owner, tuple(cached), tuple(still))

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

    def register_chain(self, pages: list[int], chain: list[tuple[int, tuple]], index: int,
                       parent: int | None) -> tuple[list[int], list[int]]:
        """register() for consecutive pages of one sequence, the first at `index` and chained
        from `parent`; chain holds each page's (hash, tokens). Returns the pages entered and
        their indices (what notify_registered reports)."""
        if not self.enable_prefix_caching:
            return [], []
        return self._ops.register_chain(self.cached, self.page_hash, self.page_tokens, self.page_index,
                                        self.page_parent, pages, chain, index, parent)

    def walk(self, chain: list[tuple[int, tuple]], n: int) -> tuple[list[int], list[int]]:
        """The cached pages (and hashes) of the longest prefix among chain's first n pages,
        lookup() page by page until the first miss."""
        return self._ops.walk(chain, n, self.cached, self.page_tokens)

    def notify_registered(self, pages: list[int], indices: list[int], owner: Owner) -> None:
        """Tell the observer which pages register() just entered for owner (one call per sequence and step)."""
        if self.observer is not None and pages:
            self.observer(PagesRegistered, tuple(pages), tuple(indices), owner)

    def forget(self, pages: Iterable[int]) -> list[int]:
        """Drop the prefix hash of these pages (a prefix-cache flush); returns those that had one.

        A free page among them stays free but is no longer reusable as a prefix; the
        observer hears PagesEvicted, so event consumers (time travel, views) stay in step.
        No owner: the pages' holders keep them.
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
            self.observer(PagesEvicted, tuple(dropped))
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

    def free_pages(self) -> tuple[int, ...]:
        """The free page ids in free-queue order (next to evict first), a read-only copy."""
        return tuple(self.free_order())

    def holders(self, page: int) -> int:
        """How many references hold `page` now (its refcount; 0: free). The pool keeps no owner per
        page: each call's owner goes only to the observer (the Pages* events), so which requests hold
        it is for the live sequences' page lists to say (what page_table's scan checks this against)."""
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} outside the pool [0, {self.num_pages})")
        return self.ref[page]

    def free_queue(self) -> "FreeQueueView":
        """The free queue's raw links, read-only, for a checker that walks them itself (the
        pool_accounting probe): it must not trust free_order(), the pool's own walk."""
        return FreeQueueView(memoryview(self._is_free).toreadonly(), self._head, memoryview(self._next).toreadonly(),
                             memoryview(self._prev).toreadonly())
