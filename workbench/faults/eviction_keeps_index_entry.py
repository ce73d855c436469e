"""eviction_keeps_index_entry: handing out a cached-free page forgets to drop it from the prefix
index (vLLM's block pool evicts a block's hash in _maybe_evict_cached_block before reuse).

The page now holds its new owner's K/V; a later prompt with the old prefix walks the index,
finds the page (its recorded tokens still match) and attends over another request's K/V.
Outputs change only for requests that hit that prefix after the page was reused.
"""
from __future__ import annotations

from .base import Fault, forget_cached_since


class EvictionKeepsIndexEntry(Fault):
    name = "eviction_keeps_index_entry"
    symptom = "garbled output only on prefix-cache hits, after the pool has cycled through its free pages"
    cause = "a cached-free page handed out to a new request keeps its prefix-index entry"
    caught_by = "prefix_cache probe: an indexed page written by another request (prefix-index-stale), a hit " \
                "whose page holds another history than the requester's (prefix-history)"
    fix = "evict a page's hash before handing it out (PagePool.allocate), and flush the prefix cache " \
          "(engine.reset_prefix_cache()) after the fix"
    notebook = ""

    def on_enable(self) -> None:
        pool = self.engine.pool
        allocate = pool.allocate_with_generations
        self._cached_before = dict(pool.cached)
        self.kept: list[tuple[int, int]] = []     # (step, page) handed out with its index entry kept

        def allocate_keeping_entries(n, owner):
            entries = {}
            p = pool.free_queue().head
            nxt = pool.free_queue().next
            for _ in range(min(n, pool.num_free)):            # the pages the hand-out takes, head first
                if pool.page_hash[p] is not None:
                    entries[p] = (pool.page_hash[p], pool.page_tokens[p], pool.page_index[p], pool.page_parent[p])
                p = nxt[p]
            pages, gens = allocate(n, owner)
            for p, (h, tokens, index, parent) in entries.items():
                if p in pages and h not in pool.cached:       # the bug: the entry stays
                    pool.cached[h] = p
                    pool.page_hash[p], pool.page_tokens[p] = h, tokens
                    pool.page_index[p], pool.page_parent[p] = index, parent
                    self.kept.append((self.engine.step_count, p))
            return pages, gens

        self.patch(pool, "allocate_with_generations", allocate_keeping_entries)

    def on_disable(self) -> None:
        self.forgotten = forget_cached_since(self.engine.pool, self._cached_before)
        pool = self.engine.pool
        pool.forget([p for _, p in self.kept])                  # entries the fault kept alive
