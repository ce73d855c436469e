"""The page-table lock, who else takes it, and the stats snapshot that keeps readers off it.

Scheduling, page allocation and binding happen under the step's lock (`step`). Who else takes it is
the field-note-6 question, EngineConfig.page_table_lock:

  "global"   every caller of add_request / abort registers under it, every stats() reader reads
             under it, and streams update their tables under it (for_key() returns it): each of
             them waits for the step's critical sections and makes the step wait
  "sharded"  those callers take only their request's / stream's shard (for_key(key)), and stats()
             returns a snapshot the engine publishes (publish), so none of them ever takes the
             step's lock; only the step (and reset_prefix_cache) still does
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from ..locks import InstrumentedLock

PAGE_TABLE_SHARDS = 8              # lock domains with page_table_lock="sharded"


class PageTableLocks:
    def __init__(self, mode: str, bus, clock: Callable[[], int]):
        self.step = InstrumentedLock("page_table", bus, clock)
        self.shards = ([InstrumentedLock(f"page_table[{i}]", bus, clock) for i in range(PAGE_TABLE_SHARDS)]
                       if mode == "sharded" else [])
        self._snap_lock = threading.Lock()        # guards the snapshot only (held for microseconds)
        self._snapshot: dict | None = None        # sharded: published at the end of Engine.__init__

    def for_key(self, key: Any) -> InstrumentedLock:
        """The lock a stream takes for its own requests and page table (add_request and abort take
        for_key(request id)): the step's own lock with "global", the key's shard with "sharded"."""
        if not self.shards:
            return self.step
        return self.shards[hash(key) % len(self.shards)]

    def read_stats(self, live: Callable[[], dict]) -> dict:
        """"global": live() under the step's lock. "sharded": a copy of the published snapshot."""
        if self.shards:
            with self._snap_lock:
                return dict(self._snapshot)
        self.step.acquire(site="engine.py stats")
        try:
            return live()
        finally:
            self.step.release()

    def publish(self, live: Callable[[], dict]) -> None:
        # Sharded only. Called on the engine thread, which mutates pool and scheduler only there,
        # or under the step's lock (reset_prefix_cache): the counters live() reads are the engine's
        # own. A step's publish racing with a reset_prefix_cache from another thread may store
        # the pre-reset counts over the reset's: stale until the next step.
        if self.shards:
            snap = live()
            with self._snap_lock:
                self._snapshot = snap

    def count_arrival(self) -> None:
        """Sharded: count a request as waiting in the published snapshot now, not at the end of the
        next step. Called before the request is queued: a publish racing with it may drop the bump
        (the request then shows from the next step's publish) but never counts it twice."""
        if self.shards:
            with self._snap_lock:
                self._snapshot["num_waiting"] += 1
