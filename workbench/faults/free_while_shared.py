"""free_while_shared: a missing refcount with prefix sharing (field note 3, vllm-ascend #5269).

When a request finishes (or is preempted), its pages go back to the free queue, cleared
of their prefix hash, even if another live request still maps them through a
prefix-cache hit. The survivor keeps reading those pages; as soon as they are handed to
a new request, that request's KV overwrites them and the survivor decodes garbage. Only
requests that hit the prefix cache are hurt, which is what made it hard to see.

Run the workload to completion inside the with-block: a request still live at exit may
map pages the fault already gave away.
"""
from __future__ import annotations

from .base import Fault, forget_cached_since


class FreeWhileShared(Fault):
    name = "free_while_shared"
    symptom = "garbage only on prefix-cache hits: a request sharing a prefix decodes nonsense after the " \
              "other sharer finishes and a new request arrives"
    cause = "the free path ignores the refcount: shared prefix pages return to the free queue while a live " \
            "request still maps them, and are reallocated under it"
    caught_by = "page_table probe: page freed while mapped, refcount != live mappers, generation changed " \
                "under a live sequence"
    fix = "free a page only when its refcount reaches 0 (PagePool.free) and take one reference per sharer " \
          "(PagePool.acquire on every prefix-cache hit)"
    notebook = "notebooks/free_while_shared.ipynb"

    def __init__(self, engine):
        super().__init__(engine)

    def on_enable(self) -> None:
        pool = self.engine.pool
        free = pool.free
        self._cached_before = dict(pool.cached)
        self.forced: list[tuple[int, int, int]] = []          # (step, page, refcount it had)

        def free_ignoring_refcount(pages, owner):
            # Each page once, and never one already on the free queue: the bug drops references,
            # it does not corrupt the queue itself.
            todo = [p for p in dict.fromkeys(pages) if not pool.is_free(p)]
            for p in todo:
                if pool.ref[p] > 1:
                    self.forced.append((self.engine.step_count, p, pool.ref[p]))
                    pool.ref[p] = 1                            # the missing refcount
                    h = pool.page_hash[p]
                    if h is not None and pool.cached.get(h) == p:
                        del pool.cached[h]
                    pool.page_hash[p] = pool.page_tokens[p] = None
            free(todo, owner)

        self.patch(pool, "free", free_ignoring_refcount)

    def on_disable(self) -> None:
        self.forgotten = forget_cached_since(self.engine.pool, self._cached_before)
