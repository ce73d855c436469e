"""InstrumentedLock: a mutex that knows who holds it, who waits for it, and for how long.

Holder and waiters are tracked always (a few dict operations, only on contention for
waiters), so the watchdog can draw the wait-for graph of a hung process; timing events
(LockWaited, LockHeld) are emitted only while someone subscribes to them.
"""
from __future__ import annotations

import sys
import threading
import time
import weakref

from .events import EventBus, LockHeld, LockWaited

_ALL_LOCKS: "weakref.WeakSet[InstrumentedLock]" = weakref.WeakSet()


def _call_site(depth: int = 2) -> str:
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename == __file__:
        f = f.f_back
    return f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno} {f.f_code.co_name}" if f else "?"


class InstrumentedLock:
    def __init__(self, name: str, bus: EventBus | None = None, step_fn=None):
        self.name = name
        self.bus = bus
        self.step_fn = step_fn or (lambda: -1)
        self._lock = threading.Lock()
        self.holder: int | None = None          # thread ident
        self.holder_name: str | None = None
        self.holder_site: str | None = None
        self.held_since_ns = 0
        self.waiters: dict[int, tuple[str, str, int]] = {}   # ident -> (thread name, site, since_ns)
        self.num_acquires = 0
        self.num_contended = 0
        _ALL_LOCKS.add(self)

    def _timed(self) -> bool:
        bus = self.bus
        return bus is not None and (bus.wants(LockWaited) or bus.wants(LockHeld))

    def acquire(self, blocking: bool = True, timeout: float = -1, site: str | None = None) -> bool:
        timed = self._timed()
        t0 = time.perf_counter_ns()
        got = self._lock.acquire(False)
        if not got:
            if not blocking:
                return False
            me = threading.current_thread()
            site = site or _call_site()
            self.waiters[me.ident] = (me.name, site, t0)
            try:
                got = self._lock.acquire(True, timeout)
            finally:
                self.waiters.pop(me.ident, None)
            if not got:
                return False
            self.num_contended += 1
        t1 = time.perf_counter_ns()
        me = threading.current_thread()
        self.holder, self.holder_name, self.held_since_ns = me.ident, me.name, t1
        self.holder_site = site if site is not None else (_call_site() if timed else None)
        self.num_acquires += 1
        if timed and self.bus.wants(LockWaited):
            self.bus.emit(LockWaited(self.step_fn(), t1, self.name, me.name, self.holder_site or "?", t1 - t0))
        return True

    def release(self) -> None:
        held_ns = time.perf_counter_ns() - self.held_since_ns
        name, site = self.holder_name, self.holder_site
        self.holder = self.holder_name = self.holder_site = None
        self._lock.release()
        bus = self.bus
        if bus is not None and bus.wants(LockHeld):
            bus.emit(LockHeld(self.step_fn(), time.perf_counter_ns(), self.name, name or "?", site or "?", held_ns))

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> "InstrumentedLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<InstrumentedLock {self.name} holder={self.holder_name} waiters={len(self.waiters)}>"


def all_locks() -> list[InstrumentedLock]:
    return list(_ALL_LOCKS)
