"""lock_inversion: two streams take the page-table lock and a stream-context lock in opposite orders.

Production (field note 6; vllm #45387, Running=0 Waiting=N): a hang. Thread 'stream-A'
updates its page table (takes the engine's page_table lock) and then needs the stream
context; thread 'stream-B' holds the stream context and needs the page table. Both
block forever, and the engine's next step blocks behind them on page_table: nothing is
ever scheduled again. The watchdog names the cycle.

disable() breaks the deadlock from a controlled path: it releases the stream-context
lock on stream-B's behalf (a plain mutex may be released by any thread), stream-A then
finishes and lets page_table go, and both threads exit, so the engine steps on.
"""
from __future__ import annotations

import threading

from ..locks import InstrumentedLock
from .base import Fault


class LockInversion(Fault):
    name = "lock_inversion"
    symptom = "a hang: the engine's step never returns, requests stay 'waiting' forever"
    cause = ("lock-order inversion: one thread holds page_table and waits for stream_context, "
             "another holds stream_context and waits for page_table")
    caught_by = "lock_contention"
    fix = "take page_table and stream_context in one global order (or use a lock domain per stream)"
    notebook = "notebooks/lock_inversion.ipynb"

    def __init__(self, engine, setup_timeout_s: float = 10.0):
        super().__init__(engine, setup_timeout_s=setup_timeout_s)
        self.setup_timeout_s = setup_timeout_s
        self.table = engine.lock
        self.ctx = InstrumentedLock("stream_context", engine.bus, lambda: engine.step_count)
        self._a_holds, self._b_holds = threading.Event(), threading.Event()
        self._broken = False
        self.threads: list[threading.Thread] = []
        self.deadlocked = False         # both threads were seen blocked on each other

    def on_enable(self) -> None:
        a = threading.Thread(target=self._stream_a, name="stream-A", daemon=True)
        b = threading.Thread(target=self._stream_b, name="stream-B", daemon=True)
        self.threads = [a, b]
        a.start()
        b.start()
        # Return only once the deadlock is real: each thread is a waiter of the other's lock.
        done = threading.Event()
        for _ in range(int(self.setup_timeout_s / 0.005)):
            if a.ident in self.ctx.waiters and b.ident in self.table.waiters:
                self.deadlocked = True
                break
            done.wait(0.005)

    def _stream_a(self) -> None:
        with self.table:                          # page table first ...
            self._a_holds.set()
            self._b_holds.wait(self.setup_timeout_s)
            with self.ctx:                        # ... then the stream context: blocks on stream-B
                pass

    def _stream_b(self) -> None:
        self.ctx.acquire()                        # stream context first ...
        self._b_holds.set()
        self._a_holds.wait(self.setup_timeout_s)
        self.table.acquire()                      # ... then the page table: blocks on stream-A
        self.table.release()
        if not self._broken:                      # disable() released the context for us
            self.ctx.release()

    def on_disable(self) -> None:
        b = self.threads[1] if len(self.threads) > 1 else None
        wait = threading.Event()
        for _ in range(int(self.setup_timeout_s / 0.005)):
            if not any(t.is_alive() for t in self.threads):
                break
            if (b is not None and not self._broken and self.ctx.holder == b.ident
                    and b.ident in self.table.waiters):
                self._broken = True
                self.ctx.release()                # on stream-B's behalf: stream-A proceeds
            wait.wait(0.005)
        for t in self.threads:
            t.join(timeout=self.setup_timeout_s)
        self.threads.clear()
