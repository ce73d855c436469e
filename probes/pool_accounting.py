"""pool_accounting: the page pool's books, recomputed from its pages (SGLang's anchor and more).

Every `every` steps and whenever the engine goes idle (EngineIdle), from the pool's
per-page arrays and a walk of its free queue, never from its counters alone:
- every page is free (refcount 0, on the free queue) or used (refcount > 0, off it):
  free + cached-free + used == total, and the counters say the same;
- the free queue is one chain whose links agree both ways and which holds exactly the
  pages flagged free (vLLM's free-queue check);
- the prefix index and the pages' hashes agree;
- every used page is mapped by a live sequence's page list; at idle nothing is used;
- a request that is not running (new, or preempted and re-queued) holds no pages.
  A used page nobody maps is a leak: the finding names the request that last held it
  (from the pool's allocation and share events) and how that request left — finish,
  abort or preemption — which is the release path to fix.

Pages an owner takes outside any request (a named reservation: a string owner passed to
pool.allocate, as the pool_pressure fault does) are reported at warn, as held, not as a leak.

Cost per check: list->array conversions of the pool's arrays and a Python walk of the
free queue, O(num_pages) (~0.3 ms at 2,048 pages, ~20 ms at 131,072): sampled.
"""
from __future__ import annotations

import time
from collections import defaultdict
from itertools import chain
from typing import Any

import numpy as np

from workbench.events import (EngineIdle, PagesAllocated, PagesShared, RequestFinished, RequestPreempted,
                              StepFinished)
from workbench.probe import Probe

from . import invariants

PATHS = {
    "abort": ("abort", "the abort path (Engine.abort -> Scheduler.finish(seq, 'abort') -> "
                       "KVCacheManager.release) did not give the request's pages back"),
    "preempted": ("preemption", "the preemption path (Scheduler._preempt -> KVCacheManager.release) dropped "
                                "the request's page list without freeing every page"),
    "finished": ("finish", "the finish path (Scheduler.finish -> KVCacheManager.release) did not free every page "
                           "of the finished request"),
}
HINT_BOOKS = ("the pool's per-page state and its counters disagree: every path that moves a page (allocate, "
              "acquire, free, forget) must update the free flag, the free queue links, the refcount and the "
              "counters together")


class PoolAccountingProbe(Probe):
    name = "pool_accounting"
    description = "pool books from its pages: free + cached + used == total, free queue, prefix index, leaks"

    def __init__(self, every: int = 16, max_rows: int = 100_000, **params: Any):
        super().__init__(every=every, max_rows=max_rows, **params)
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        self.every, self.max_rows = every, max_rows
        self.checks = 0
        self._holder: dict[int, Any] = {}        # page -> the last request (or owner) that took it
        self._fate: dict[Any, tuple] = {}        # request -> (how it left, step, detail)

    def on_attach(self, engine) -> None:
        self.listen(PagesAllocated, self._took)
        self.listen(PagesShared, self._took)
        self.listen(RequestFinished, self._finished)
        self.listen(RequestPreempted, self._preempted)
        self.listen(StepFinished, self._on_step)
        self.listen(EngineIdle, lambda e: self.check(e.step, idle=True))

    # ---- who held what -------------------------------------------------------------
    def _took(self, e) -> None:
        h = self._holder
        for p in e.pages:
            h[p] = e.request_id
        if e.request_id in self._fate and self._fate[e.request_id][0] == "preempted":
            del self._fate[e.request_id]           # re-admitted after a preemption: live again

    def _finished(self, e: RequestFinished) -> None:
        self._fate[e.request_id] = ("abort" if e.reason == "abort" else "finished", e.step, e.reason)
        if len(self._fate) > 200_000:              # bounded: forget the oldest half
            for k in list(self._fate)[:100_000]:
                del self._fate[k]

    def _preempted(self, e: RequestPreempted) -> None:
        self._fate[e.request_id] = ("preempted", e.step, e.num_pages_freed)
        self._held_while_waiting(e.step, False, only=e.request_id)   # at once: the step may never finish

    def _on_step(self, e: StepFinished) -> None:
        if e.step % self.every == 0:
            self.check(e.step)

    # ---- the check -----------------------------------------------------------------
    def check(self, step: int | None = None, idle: bool = False) -> dict:
        """Recompute the pool's books now; returns the counts (also a frame() row)."""
        t0 = time.perf_counter_ns()
        eng = self.engine
        step = eng.step_count if step is None else step
        pool = eng.pool
        n = pool.num_pages
        ref = np.asarray(pool.ref, dtype=np.int64)
        fq = pool.free_queue()                            # the raw links: the probe walks them itself
        is_free = np.asarray(fq.is_free, dtype=bool)
        page_hash = pool.page_hash
        has_hash = np.fromiter((h is not None for h in page_hash), dtype=bool, count=n)
        walk, walk_err = invariants.walk_free_queue(fq.head, fq.next, n)
        found = invariants.pool_violations(ref, is_free, has_hash, walk, walk_err,
                                           np.asarray(fq.prev, dtype=np.int64), pool.num_free,
                                           pool.num_cached_free, pool.cached, page_hash)
        for v in found:
            self.report("error", f"pool books ({v.rule}): {v.message}; pages {list(v.pages)}", hint=HINT_BOOKS,
                        kind=f"pool-{v.rule}", dedup=("pool", v.rule, v.pages[:1]), step=step,
                        page=v.pages[0] if v.pages else None,
                        evidence={"rule": v.rule, "pages": list(v.pages), "idle": idle,
                                  "num_free": pool.num_free, "num_cached_free": pool.num_cached_free})
        held = self._held_while_waiting(step, idle)
        live = [s for s in eng.live_sequences() if s.pages]
        mapped = np.zeros(n, dtype=np.int64)
        if live:
            pages = np.fromiter(chain.from_iterable(s.pages for s in live), dtype=np.int64,
                                count=sum(len(s.pages) for s in live))
            pages = pages[(pages >= 0) & (pages < n)]
            mapped = np.bincount(pages, minlength=n)
        unmapped = np.nonzero((ref > 0) & (mapped == 0))[0]
        leaked = self._report_unmapped(unmapped, ref, step, idle)
        row = {"step": step, "idle": idle, "pages_total": n, "free": int(is_free.sum()),
               "cached_free": int((is_free & has_hash).sum()), "used": int((ref > 0).sum()),
               "queue_len": len(walk), "unmapped_used": int(len(unmapped)), "leaked": leaked,
               "violations": len(found), "held_while_waiting": held, "check_us": (time.perf_counter_ns() - t0) / 1e3}
        self.checks += 1
        self.rows.append(row)
        if len(self.rows) > self.max_rows:
            del self.rows[: len(self.rows) // 2]
        return row

    def _held_while_waiting(self, step: int, idle: bool, only=None) -> int:
        """A request that is not running (new, or preempted and re-queued) holds no pages: the
        preemption path gives them all back (the same rule the vLLM plugin checks against its ledger)."""
        n = 0
        for s in list(self.engine.scheduler.waiting):
            if s.pages and (only is None or s.request_id == only):
                n += 1
                self.report("error", f"request {s.request_id} is waiting (preempted {s.num_preemptions} times) but "
                                     f"still holds {len(s.pages)} pages", hint=PATHS["preempted"][1],
                            kind="held-while-waiting", dedup=("held-while-waiting", s.request_id, s.num_preemptions),
                            step=step, request_id=s.request_id, page=s.pages[0],
                            evidence={"pages": list(s.pages[:16]), "preemptions": s.num_preemptions, "idle": idle})
        return n

    def _report_unmapped(self, pages: np.ndarray, ref: np.ndarray, step: int, idle: bool) -> int:
        by_holder = defaultdict(list)
        for p in pages.tolist():
            by_holder[self._holder.get(p)].append(p)
        leaked = 0
        for holder, ps in by_holder.items():
            if isinstance(holder, str):           # a named reservation outside any request
                self.report("warn", f"{len(ps)} pages are held by '{holder}', outside any request; they shrink "
                                    f"the pool requests can use", kind="pool-reserved",
                            hint="give the pages back when the reservation ends", step=step, page=ps[0],
                            dedup=("pool-reserved", holder, len(ps)),
                            evidence={"owner": holder, "pages": ps[:64], "count": len(ps)})
                continue
            leaked += len(ps)
            how, at, detail = self._fate.get(holder, (None, None, None))
            path, why = PATHS.get(how, ("unknown", "a release path did not free the page"))
            when = "" if at is None else f" at step {at}"
            left = {"abort": "was aborted", "preempted": "was preempted", "finished": f"finished ({detail})"}.get(
                how, "is not live")
            self.report(
                "error", f"{len(ps)} pages leaked{' at idle' if idle else ''}: pages {ps[:8]} have refcount "
                         f"{int(ref[ps[0]])}{'+' if len(ps) > 1 else ''} but no live request maps them; they were "
                         f"last held by request {holder}, which {left}{when} (release path: {path})",
                hint=f"{why}; until fixed, the pool shrinks by these pages every time this happens and the server "
                     f"ends preempting or out of pages", kind="page-leak",
                dedup=("page-leak", holder, ps[0]), step=step, request_id=holder, page=ps[0],
                evidence={"pages": ps[:64], "count": len(ps), "last_holder": holder, "release_path": path,
                          "left_at_step": at, "idle": idle, "refcounts": [int(ref[p]) for p in ps[:64]]})
        return leaked

    def frame(self):
        import pandas as pd
        cols = ["step", "idle", "pages_total", "free", "cached_free", "used", "queue_len", "unmapped_used",
                "leaked", "violations", "check_us"]
        return pd.DataFrame(self.rows, columns=cols)
