"""lock_storm: every stream's submission, table update and abort, and every metrics reader, take the step's lock.

Production (field note 6): batch 16, the first 10 requests fine, the last 6 stuck
"waiting"; page-table updates went through one global lock shared by all streams.
Here `submitters` threads stand for the other streams. Each, in a loop:

* rewrites its own host page table under the lock its engine gives it
  (engine.table_lock(key)) and keeps the lock across the host-to-device copy (a
  `hold_s` sleep, which releases the GIL as a device sync would): the stream's own
  work, the one part this fault simulates;
* calls the engine's real abort() (and, with submit=True, its real add_request()):
  the engine's own registration path, which with page_table_lock="global" takes the
  step's lock and with "sharded" only the request's shard lock.

`metrics` threads scrape the engine's real stats() in a tight loop. Every call the
fault's threads make to add_request / abort / stats is timed (`calls`, `latency_frame()`).

Which real paths, and why (the run being diagnosed must stay the user's run):
* submit=False (default): each stream aborts its own key, a negative id the engine
  never issues. That is engine.abort() itself, lock and all; the engine drops a
  negative id instead of queueing it, so the served requests, their outputs, the
  event stream and EngineIdle are exactly those of a quiet run: the symptom is only
  the time the step spends waiting.
* submit=True: each stream also submits a one-token greedy request (max_tokens=1)
  with add_request and aborts it at once, to time add_request too. These are real
  requests: when the engine drains the add before the abort (likely with the global
  lock, where the abort waits), the request joins one step's batch, which changes
  that batch's shape and so possibly the served requests' floating-point results.
  Use it to measure the paths, never in a run whose outputs you compare; after the
  fault, a pair may still be queued: step the engine until has_unfinished() is False.

With EngineConfig(page_table_lock='sharded') the same storm goes to shard locks and a
published stats snapshot, and the step stops waiting.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from ..engine.sequence import SamplingParams
from .base import Fault

KEEP = 65536                       # latency samples kept per call


class LockStorm(Fault):
    name = "lock_storm"
    symptom = "throughput collapse: steps slow down and later requests sit 'waiting' while streams update tables"
    cause = ("one global page-table lock shared by the step, every stream's submission, table update and abort, "
             "and every stats() reader")
    caught_by = "lock_contention"
    fix = ("EngineConfig(page_table_lock='sharded'): a lock domain per stream for add_request, abort and "
           "table updates, stats() from a published snapshot")
    notebook = "notebooks/lock_storm.ipynb"

    TINY_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def __init__(self, engine, submitters: int = 6, metrics: int = 2, hold_s: float = 0.005,
                 gap_s: float = 0.0005, scrape_s: float = 0.0005, submit: bool = False):
        super().__init__(engine, submitters=submitters, metrics=metrics, hold_s=hold_s, gap_s=gap_s,
                         scrape_s=scrape_s, submit=submit)
        self.submitters, self.metrics = submitters, metrics
        self.hold_s, self.gap_s, self.scrape_s = hold_s, gap_s, scrape_s
        self.submit = submit
        self._stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.updates = 0          # page-table updates done by the stream threads
        self.aborts = 0           # engine.abort() calls by the stream threads
        self.submitted = 0        # engine.add_request() calls by the stream threads (submit=True)
        self.scrapes = 0          # stats() calls done by the metrics threads
        # Wall time of each call the fault's threads make to the engine's real paths, in ns.
        self.calls: dict[str, deque] = {c: deque(maxlen=KEEP) for c in ("add_request", "abort", "stats")}

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
        key = -1000 - i                      # stream i's key: a negative id, never one the engine issues
        lock = eng.table_lock(key)           # the global page-table lock, or this stream's shard
        width = eng.builder.block_tables.max_pages_per_seq
        table = np.zeros(width, dtype=np.int32)        # this stream's own host page table
        tiny = [1 % eng.model_config.vocab_size]
        clock = time.perf_counter_ns
        n = 0
        while not self._stop.is_set():
            with lock:
                n += 1
                table[:] = (np.arange(width, dtype=np.int32) + n) % eng.num_pages    # the update
                self._stop.wait(self.hold_s)     # the host-to-device copy, still under the lock
            self.updates += 1
            if self.submit:
                t0 = clock()
                rid = eng.add_request(tiny, self.TINY_PARAMS)       # the real submission path
                t1 = clock()
                eng.abort(rid)                                      # and the real abort of it
                t2 = clock()
                self.calls["add_request"].append(t1 - t0)
                self.submitted += 1
            else:
                t1 = clock()
                eng.abort(key)                                      # the real abort path, a no-op id
                t2 = clock()
            self.calls["abort"].append(t2 - t1)
            self.aborts += 1
            self._stop.wait(self.gap_s)

    def _scraper(self) -> None:
        eng = self.engine
        clock = time.perf_counter_ns
        while not self._stop.is_set():
            t0 = clock()
            eng.stats()
            self.calls["stats"].append(clock() - t0)
            self.scrapes += 1
            self._stop.wait(self.scrape_s)

    def latency_frame(self):
        """One row per engine call the fault's threads made: count and latency percentiles (ms)."""
        import pandas as pd
        rows = []
        for call, samples in self.calls.items():
            a = np.array(samples, dtype=np.int64) / 1e6
            if not len(a):
                continue
            rows.append({"call": call, "count": len(a), "p50_ms": float(np.percentile(a, 50)),
                         "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max())})
        return pd.DataFrame(rows, columns=["call", "count", "p50_ms", "p99_ms", "max_ms"])
