"""write_into_cached_page: one decode token's K/V is written into a page the prefix index still
holds (a slot mapping built from a stale page-table row that names a freed, cached page).

The page's index entry now points at K/V partly written by another request; a later prompt with
that page's prefix hits it and attends over the foreign K/V at that slot. The writer loses the
token too: its own slot is never written.
"""
from __future__ import annotations

from .base import Fault, forget_cached_since


class WriteIntoCachedPage(Fault):
    name = "write_into_cached_page"
    symptom = "garbled output for later requests that share a cached prefix, and for the request whose write " \
              "went astray"
    cause = "a slot mapping entry names a slot of a cached-free page (a stale page-table row) and the KV write " \
            "lands there"
    caught_by = "prefix_cache probe: an indexed page written by another request (prefix-index-stale); packing " \
                "and page_table: the slot mapping disagrees with the request's pages"
    fix = "build the slot mapping from the request's current page list (BatchBuilder.build), never a cached row"
    notebook = ""

    def __init__(self, engine, times: int = 1):
        """Redirect one decode write in each of the first `times` steps that have a cached-free page."""
        super().__init__(engine, times=times)
        self.times = times

    def on_enable(self) -> None:
        eng = self.engine
        build = eng.builder.build
        self._cached_before = dict(eng.pool.cached)
        self.redirected: list[dict] = []         # step, request_id, position, page, slot

        def build_then_misdirect(scheduled, *a, **kw):
            batch = build(scheduled, *a, **kw)
            if len(self.redirected) < self.times:
                self._misdirect(batch)
            return batch

        self.patch(eng.builder, "build", build_then_misdirect)

    def _misdirect(self, batch) -> None:
        pool, ps = self.engine.pool, self.engine.pool.page_size
        cached = [p for p in pool.cached.values() if pool.is_free(p)]
        q = batch.query_lens_np
        rows = [i for i in range(batch.num_seqs) if q[i] == 1]
        if not cached or not rows:
            return
        i, page = rows[-1], cached[0]
        tok = int(batch.cu_seqlens_q_np[i])
        seq = batch.seqs[i]
        pos = seq.num_computed_tokens
        slot = page * ps + pos % ps
        batch.slot_mapping[tok] = slot
        self.redirected.append({"step": self.engine.step_count, "request_id": seq.request_id, "position": pos,
                                "page": page, "slot": slot})

    def on_disable(self) -> None:
        self.forgotten = forget_cached_since(self.engine.pool, self._cached_before)
        self.engine.pool.forget([r["page"] for r in self.redirected])
