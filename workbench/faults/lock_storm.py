"""lock_storm: every stream's page-table update and every metrics reader take the step's lock.

Production (field note 6): batch 16, the first 10 requests fine, the last 6 stuck
"waiting"; page-table updates went through one global lock shared by all streams.
Here `submitters` threads stand for the other streams: each rewrites its own host page
table under the lock its engine gives it (engine.table_lock(stream)) and keeps the lock
across the host-to-device copy (a `hold_s` sleep, which releases the GIL as a device
sync would); `metrics` threads scrape engine.stats() in a tight loop. None of them
touches the requests being served: the symptom is only the time the step spends
waiting. With EngineConfig(page_table_lock='sharded') the same storm goes to shard
locks and a published stats snapshot, and the step stops waiting.
"""
from __future__ import annotations

import threading

import numpy as np

from .base import Fault


class LockStorm(Fault):
    name = "lock_storm"
    symptom = "throughput collapse: steps slow down and later requests sit 'waiting' while streams update tables"
    cause = "one global page-table lock shared by the step, every stream's table update and every stats() reader"
    caught_by = "lock_contention"
    fix = "EngineConfig(page_table_lock='sharded'): a lock domain per stream, stats() from a published snapshot"
    notebook = "notebooks/lock_storm.ipynb"

    def __init__(self, engine, submitters: int = 6, metrics: int = 2, hold_s: float = 0.005,
                 gap_s: float = 0.0005, scrape_s: float = 0.0005, **params):
        super().__init__(engine, **params)
        self.submitters, self.metrics = submitters, metrics
        self.hold_s, self.gap_s, self.scrape_s = hold_s, gap_s, scrape_s
        self._stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.updates = 0          # page-table updates done by the stream threads
        self.scrapes = 0          # stats() calls done by the metrics threads

    def on_enable(self) -> None:
        self._stop.clear()
        for i in range(self.submitters):
            self.threads.append(threading.Thread(target=self._stream, args=(i,), name=f"stream-{i}", daemon=True))
        for i in range(self.metrics):
            self.threads.append(threading.Thread(target=self._scraper, name=f"metrics-{i}", daemon=True))
        for t in self.threads:
            t.start()

    def on_disable(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(timeout=10)
        self.threads.clear()

    def _stream(self, i: int) -> None:
        eng = self.engine
        lock = eng.table_lock(i)             # the global page-table lock, or stream i's shard
        width = eng.builder.block_tables.max_pages_per_seq
        table = np.zeros(width, dtype=np.int32)        # this stream's own host page table
        n = 0
        while not self._stop.is_set():
            with lock:
                n += 1
                table[:] = (np.arange(width, dtype=np.int32) + n) % eng.num_pages    # the update
                self._stop.wait(self.hold_s)     # the host-to-device copy, still under the lock
            self.updates += 1
            self._stop.wait(self.gap_s)

    def _scraper(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            eng.stats()
            self.scrapes += 1
            self._stop.wait(self.scrape_s)
