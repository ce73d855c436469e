"""Time travel: the page pool at any past step, rebuilt from the EventLog.

One pass over the page events stores a keyframe (refcounts, owners, cached flags) every
`keyframe_every` steps; state_at(step) copies the nearest keyframe at or before it and
replays only the events since, so a lookup costs O(keyframe interval), not O(history).
Like PyTorch's memory_viz: a timeline plus the pool state at any event, scrubbable.
"""
from __future__ import annotations

import bisect
import gc
from dataclasses import dataclass, field

import numpy as np

from ..engine.pages import POOL_EVENTS
from ..events import PagesAllocated, PagesEvicted, PagesFreed, PagesRegistered, PagesShared

FREE, CACHED, OWNED, SHARED = 0, 1, 2, 3
STATE_NAMES = ("free", "cached", "owned", "shared")


@dataclass
class PoolState:
    step: int
    ref: np.ndarray                      # int32 refcount per page
    owner: np.ndarray                    # int64 first owner per page, -1 when free
    cached: np.ndarray                   # bool: a free page still carrying a prefix hash
    shared_owners: dict = field(default_factory=dict)    # page -> tuple of every owner (shared pages)

    def copy(self) -> "PoolState":
        return PoolState(self.step, self.ref.copy(), self.owner.copy(), self.cached.copy(), dict(self.shared_owners))

    @property
    def states(self) -> np.ndarray:
        """uint8 per page: 0 free, 1 cached-free, 2 owned, 3 shared (what the page map draws)."""
        s = np.where(self.ref > 1, SHARED, np.where(self.ref == 1, OWNED, np.where(self.cached, CACHED, FREE)))
        return s.astype(np.uint8)

    def owner_sets(self) -> dict[int, frozenset]:
        out = {int(p): frozenset([int(self.owner[p])]) for p in np.nonzero(self.ref > 0)[0]}
        out.update({p: frozenset(o) for p, o in self.shared_owners.items()})
        return out

    def counts(self) -> dict:
        s = self.states
        return {name: int((s == i).sum()) for i, name in enumerate(STATE_NAMES)}

    def frame(self):
        import pandas as pd
        s = self.states
        return pd.DataFrame({"page": np.arange(len(s)), "state": np.array(STATE_NAMES)[s], "ref": self.ref,
                             "owner": self.owner,
                             "owners": [self.shared_owners.get(p, ()) for p in range(len(s))]})

    @classmethod
    def empty(cls, num_pages: int, step: int = 0) -> "PoolState":
        return cls(step, np.zeros(num_pages, np.int32), np.full(num_pages, -1, np.int64),
                   np.zeros(num_pages, bool))

    @classmethod
    def from_engine(cls, engine) -> "PoolState":
        """The live pool as it is now (to compare with what time travel rebuilds)."""
        pool = engine.pool
        n = pool.num_pages
        st = cls.empty(n, engine.step_count)
        st.ref[:] = pool.ref
        st.cached[:] = [pool.is_free(p) and pool.page_hash[p] is not None for p in range(n)]
        holders: dict[int, list] = {}
        for seq in engine.scheduler.running + list(engine.scheduler.waiting):
            for p in seq.pages:
                holders.setdefault(p, []).append(seq.request_id)
        for p, rids in holders.items():
            st.owner[p] = rids[0]
            if len(rids) > 1:
                st.shared_owners[p] = tuple(rids)
        return st


# The appliers run once per pool event over a replay's millions of pages: whole page lists go
# through numpy's fancy indexing, not a Python loop per page.
def _index(pages) -> np.ndarray:
    return np.asarray(pages, dtype=np.intp)


def _forget_shared(st: PoolState, pages) -> None:
    if st.shared_owners:
        for p in st.shared_owners.keys() & set(pages):
            del st.shared_owners[p]


def _allocated(st: PoolState, pages, rid, cached, still) -> None:
    idx = _index(pages)
    st.ref[idx] = 1
    st.owner[idx] = rid
    st.cached[idx] = False
    _forget_shared(st, pages)


def _shared(st: PoolState, pages, rid, cached, still) -> None:
    for p in pages:
        st.ref[p] += 1
        if st.ref[p] == 1:                       # revived from the cached-free list
            st.owner[p], st.cached[p] = rid, False
        else:
            st.shared_owners[p] = st.shared_owners.get(p, (int(st.owner[p]),)) + (rid,)


def _freed(st: PoolState, pages, rid, cached, still) -> None:
    idx = _index(pages)
    st.ref[idx] = 0
    st.owner[idx] = -1
    st.cached[idx] = False
    st.cached[_index(cached)] = True              # of the freed pages, those keeping their prefix hash
    _forget_shared(st, pages)
    for p in still:
        st.ref[p] -= 1
        owners = list(st.shared_owners.get(p, (int(st.owner[p]),)))
        if rid in owners:
            owners.remove(rid)
        st.owner[p] = owners[0] if owners else -1
        if len(owners) > 1:
            st.shared_owners[p] = tuple(owners)
        else:
            st.shared_owners.pop(p, None)


def _evicted(st: PoolState, pages, rid, cached, still) -> None:   # the prefix hash is gone
    st.cached[_index(pages)] = False


# How each of the pool's events (pages.POOL_EVENTS, the types the pool reports) changes the
# state; PagesRegistered changes no refcount, owner or free flag.
APPLY = {PagesAllocated: _allocated, PagesShared: _shared, PagesFreed: _freed, PagesEvicted: _evicted,
         PagesRegistered: None}
assert set(APPLY) == set(POOL_EVENTS), "a pool event type time travel does not know"


class TimeTravel:
    def __init__(self, log, num_pages: int, keyframe_every: int | None = None):
        # Building makes a row per page event (a replay has hundreds of thousands) and no cycles:
        # the cyclic collector is paused meanwhile instead of rescanning the log under it.
        was_on = gc.isenabled()
        gc.disable()
        try:
            self._build(log, num_pages, keyframe_every)
        finally:
            if was_on:
                gc.enable()

    def _build(self, log, num_pages: int, keyframe_every: int | None) -> None:
        self.num_pages = num_pages
        cols = []
        for et, fn in APPLY.items():
            if fn is None:
                continue
            df = log.frame(et)
            if df.empty:
                continue
            n = len(df)
            rid = df["request_id"].tolist() if "request_id" in df else [None] * n
            cached = df["cached"].tolist() if "cached" in df else [()] * n
            still = df["still_shared"].tolist() if "still_shared" in df else [()] * n
            cols.extend(zip(df["seq"].tolist(), df["step"].tolist(), [fn] * n, df["pages"].tolist(),
                            rid, cached, still))
        cols.sort(key=lambda r: r[0])
        self.events = cols
        self.steps = [r[1] for r in cols]
        last = self.steps[-1] if cols else 0
        self.keyframe_every = keyframe_every or max(16, last // 256 + 1)
        self.last_step = last
        self._keyframes: list[PoolState] = []
        self._key_index: list[int] = []          # index into events where each keyframe resumes
        st = PoolState.empty(num_pages, 0)
        i = 0
        for k in range(0, last + 1, self.keyframe_every):
            while i < len(cols) and cols[i][1] <= k:
                e = cols[i]
                e[2](st, *e[3:])
                i += 1
            snap = st.copy()
            snap.step = k
            self._keyframes.append(snap)
            self._key_index.append(i)

    def state_at(self, step: int) -> PoolState:
        """The pool as it stood at the end of `step`."""
        if step < 0:
            raise ValueError(f"step {step} < 0")
        if not self._keyframes:
            return PoolState.empty(self.num_pages, step)
        k = min(step // self.keyframe_every, len(self._keyframes) - 1)
        st = self._keyframes[k].copy()
        i = self._key_index[k]
        end = bisect.bisect_right(self.steps, step)
        for e in self.events[i:end]:
            e[2](st, *e[3:])
        st.step = step
        return st


def state_at(log, num_pages: int, step: int) -> PoolState:
    """One-off lookup; build a TimeTravel once when scrubbing."""
    return TimeTravel(log, num_pages).state_at(step)
