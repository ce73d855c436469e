"""prefix_cache: a shared page must hold the requester's own history, not just equal tokens.

A prefix-cache hit is trusted once the page's tokens match. But a page's K/V depends on
its position (RoPE) and on every token before it: a chain hash that forgets its parent,
a registration under the wrong page index, an index entry that outlived its page's eviction
or a page rewritten while still indexed serves K/V computed for another history, and the text
garbles with every check on the tokens passing. The probe's reference is what was written,
never the index's own records:

- every step (StepFinished), the page write ledger (probes/page_writes.py) checks the positions
  each request holds without having computed them (its prefix-cache hits): the requester's own
  prefix digest at each cached position must equal the digest last written to the slot its own
  page list names. A mismatch is an error naming both requests, the page and the first differing
  position. Then it records the step's writes from the step record (the slot mapping the kernel
  was handed, the requests' tokens).
- the index is audited against the ledger: each page written this step that the index holds must
  hold what the index says (one writer's history, at the index's position, its tokens). An entry
  that outlived its page (kept through an eviction, or its page rewritten under it) is an error
  naming the writer and the page.
- on PagesRegistered: the page's true index is where it sits in the registering sequence's own
  page list; a registration under another index, or of a page not yet fully computed, is an error.

Cost: numpy over the step's tokens (one cumulative sum), plus the hit pages at admission and
the written pages the index holds.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from probes import page_writes_native
from probes.page_writes import PageWriteLedger
from workbench.events import EngineIdle, PagesRegistered, RequestFinished, StepFinished
from workbench.probe import Probe

HINT_HIT = ("the prefix cache served a page computed for another history: a page's key must chain its "
            "parent's hash (hash_page(parent, tokens)) and be registered under its own index "
            "(KVCacheManager.cache_full_pages), and a page handed out again must leave the index first "
            "(PagePool.allocate evicts it); flush the prefix cache (engine.reset_prefix_cache()) after the fix")
HINT_REG = ("a page was entered in the prefix cache under another index than the one it holds in the "
            "registering sequence (or before it was full): check KVCacheManager.cache_full_pages")
HINT_INDEX = ("the prefix index maps a hash to a page that now holds another request's K/V: an eviction "
              "(PagePool.allocate handing out a cached-free page) must drop the page's entry, and nothing "
              "may write into an indexed page; flush the prefix cache (engine.reset_prefix_cache()) after the fix")


class PrefixCacheProbe(Probe):
    name = "prefix_cache"
    description = "prefix-cache hits checked against a ledger of what each page slot was last written with"

    def __init__(self, **params: Any):
        super().__init__(**params)
        self.ledger: PageWriteLedger | None = None
        self._pool = None
        self._whole = False                 # watching since the engine's first step: every slot is known
        self._ended: list = []              # requests finished since the last step: their digests go
        self.registrations_checked = 0
        self.hits_checked = 0               # cached positions checked against the ledger
        self.index_pages_checked = 0

    def on_attach(self, engine) -> None:
        self.listen(PagesRegistered, self.on_registered)
        self.listen(StepFinished, self.on_step)
        self.listen(RequestFinished, lambda e: self._ended.append(e.request_id))
        self.listen(EngineIdle, lambda e: self._forget())

    def _seq(self, rid, where) -> Any:
        for s in where:
            if s.request_id == rid:
                return s
        return None

    def _ledger(self) -> PageWriteLedger:
        pool = self.engine.pool
        if self.ledger is None or pool is not self._pool:       # a repage built another pool
            self._whole = self.ledger is None and self.engine.step_count <= 1
            self.ledger, self._pool = PageWriteLedger(pool.num_pages, pool.page_size), pool
        return self.ledger

    def _forget(self) -> None:
        if self.ledger is not None:
            for rid in self._ended:
                self.ledger.forget(rid)
        self._ended.clear()

    # ---- every step: hits against the ledger, the step's writes, the index against the ledger ----
    def on_step(self, e: StepFinished) -> None:
        eng = self.engine
        rec = eng.step_record
        if rec is None or rec.step != e.step:
            return
        led = self._ledger()
        rows = list(zip(rec.request_ids, rec.token_ids or [()] * rec.num_rows, rec.computed.tolist(),
                        rec.scheduled.tolist(), rec.pages))
        checked0 = led.positions_checked
        slots = rec.array("slot_mapping")
        # who held the step's slots before it wrote them: the index audit names them
        before = np.empty(len(slots), dtype=np.int64) if slots is not None and eng.pool.enable_prefix_caching else None
        bad = {}
        for m in page_writes_native.ledger_step(led, rows, slots, strict=self._whole, before=before):
            bad[m.request] = m.page
            self._report_hit(m, e.step)
        self.hits_checked += led.positions_checked - checked0
        for rid, lo, hi in led.verified:
            self.rows.append({"step": e.step, "request_id": rid, "cached_tokens": hi - lo, "from_position": lo,
                              "bad_page": bad.get(rid)})
        if len(self.rows) > 100_000:
            del self.rows[:50_000]
        if before is not None and led.pages_written:
            self._audit_index(slots, before, led.pages_written, e.step)
        self._forget()

    def _report_hit(self, m, step: int) -> None:
        ps = self.ledger.page_size
        if m.written_by is None:
            why = (f"nothing was ever written to its slot for position {m.position} (the page was entered in "
                   f"the index or mapped before its K/V was computed)")
        elif m.written_pos // ps != m.page_index:
            why = (f"request {m.written_by} wrote it as its page {m.written_pos // ps} (position {m.written_pos}), "
                   f"here it serves page {m.page_index}")
        elif m.same_tokens:
            why = (f"request {m.written_by} computed it after other tokens (its history differs from this "
                   f"request's before position {m.page_index * ps})")
        else:
            why = f"request {m.written_by} wrote other tokens there (first differing position {m.position})"
        self.report(
            "error", f"request {m.request}: prefix-cache hit on page {m.page} (its page {m.page_index}) is not its "
                     f"own history: {why}",
            hint=HINT_HIT, kind="prefix-history", step=step, request_id=m.request, page=m.page,
            dedup=("prefix-history", m.request, m.page),
            evidence={"page": m.page, "page_index": m.page_index, "computed_by": m.written_by,
                      "recorded_index": m.written_pos // ps, "position": m.position, "slot": m.slot,
                      "same_tokens": m.same_tokens})

    def _audit_index(self, slots, before, pages, step: int) -> None:
        """Pages written this step that the index holds must hold what the index says they hold.
        slots: the step's slot mapping; before: who held each of them before the step; pages: the
        distinct pages the step wrote."""
        pool, led = self.engine.pool, self.ledger
        ps = led.page_size
        page_hash = pool.page_hash
        for p in pages:
            if page_hash[p] is None:
                continue
            self.index_pages_checked += 1
            why = led.audit_page(p, pool.page_index[p], pool.page_tokens[p])
            if why is None:
                continue
            mine = np.asarray(slots, dtype=np.int64) // ps == p
            writer = int(led.writer[slots[mine][0]])           # who wrote into it this step
            held = sorted(set(before[mine].tolist()) - {-1, writer})
            if not held:                                       # the slots it overwrote were fresh: the page's others
                held = sorted(set(led.writer[p * ps:(p + 1) * ps].tolist()) - {-1, writer})
            self.report(
                "error", f"page {p} is in the prefix index (as page {pool.page_index[p]} of a cached history) but "
                         f"request {writer} wrote into it at step {step}: {why}"
                         + (f"; it held request {held[0]}'s K/V before" if held else ""),
                hint=HINT_INDEX, kind="prefix-index-stale", step=step, request_id=writer, page=p,
                dedup=("prefix-index-stale", p),
                evidence={"page": p, "index_says": pool.page_index[p], "written_by": writer,
                          "held_before": held[0] if held else None, "why": why})

    # ---- registration ----------------------------------------------------------------
    def on_registered(self, e: PagesRegistered) -> None:
        eng = self.engine
        rec = eng.step_record
        seq = self._seq(e.request_id, rec.batch.seqs if rec is not None and rec.batch is not None else ()) or \
            self._seq(e.request_id, eng.live_sequences())
        if seq is None:
            return
        ps = eng.pool.page_size
        where = {p: j for j, p in enumerate(seq.pages)}
        for p, claimed, j in zip(e.pages, e.page_indices, [where.get(p, -1) for p in e.pages]):
            self.registrations_checked += 1
            pool_claim = eng.pool.page_index[p]
            if j < 0 or claimed != j or pool_claim != j or (j + 1) * ps > seq.num_computed_tokens:
                why = ("it is not in the request's page list" if j < 0 else
                       f"it holds the request's page {j} but was registered as page {claimed} "
                       f"(pool record {pool_claim})" if claimed != j or pool_claim != j else
                       f"its last token is {(j + 1) * ps - 1}, the request has computed only "
                       f"{seq.num_computed_tokens}")
                self.report("error", f"request {seq.request_id}: page {p} entered the prefix cache wrongly: {why}",
                            hint=HINT_REG, kind="prefix-registration", step=e.step, request_id=seq.request_id,
                            page=p, dedup=("prefix-registration", seq.request_id, p),
                            evidence={"page": p, "true_index": j, "claimed_index": claimed,
                                      "pool_index": pool_claim, "computed_tokens": seq.num_computed_tokens})

    def frame(self):
        """One row per request whose cached positions were checked (a prefix-cache hit): how many, from
        where, and the first page that held another history (None: all its own)."""
        import pandas as pd
        return pd.DataFrame(self.rows, columns=["step", "request_id", "cached_tokens", "from_position", "bad_page"])
