"""InstrumentedLock: a mutex that knows who holds it, who waits for it, and for how long.

Holder and waiters are tracked always (a few dict operations, only on contention for
waiters), so the watchdog can draw the wait-for graph of a hung process; timing events
(LockWaited, LockHeld) are emitted only while someone subscribes to them.

The wait-for graph has an edge waiter thread -> lock -> holder thread for every thread
blocked in acquire(). A blocked thread waits for exactly one lock, so each thread has at
most one outgoing edge and a deadlock is a cycle found by walking successors.
"""
from __future__ import annotations

import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass

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
        if self._lock.acquire(False):
            t0 = t1 = time.perf_counter_ns()     # uncontended: it waited for nobody (wait_ns == 0)
        else:
            if not blocking:
                return False
            t0 = time.perf_counter_ns()
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


# ---- the wait-for graph -------------------------------------------------------
@dataclass(frozen=True)
class WaitEdge:
    """waiter thread --(lock)--> holder thread: the waiter is blocked in lock.acquire()."""
    waiter: int                  # thread idents
    waiter_name: str
    waiter_site: str             # where the waiter called acquire()
    lock: str
    lock_id: int                 # id() of the lock: two engines both have a "page_table"
    holder: int | None           # None for the instant between a release and the next holder
    holder_name: str | None
    holder_site: str | None      # where the holder acquired it
    waited_s: float
    held_s: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def _snapshot(lock: InstrumentedLock) -> tuple:
    # dict() of an int-keyed dict runs without releasing the GIL: a consistent copy.
    return lock.holder, lock.holder_name, lock.holder_site, lock.held_since_ns, dict(lock.waiters)


def wait_for_graph(locks: list[InstrumentedLock] | None = None) -> list[WaitEdge]:
    """Every thread blocked on an InstrumentedLock, with the thread that holds it (all locks by default)."""
    now = time.perf_counter_ns()
    edges = []
    for lock in (all_locks() if locks is None else locks):
        holder, hname, hsite, since, waiters = _snapshot(lock)
        for ident, (wname, wsite, t0) in waiters.items():
            edges.append(WaitEdge(ident, wname, wsite, lock.name, id(lock), holder, hname, hsite,
                                  (now - t0) / 1e9, (now - since) / 1e9 if holder is not None else None))
    return edges


def find_cycle(edges: list[WaitEdge] | None = None) -> list[WaitEdge]:
    """A deadlock: edges e0..en with e[i].holder == e[i+1].waiter and en.holder == e0.waiter; [] if none.

    Threads blocked *behind* a cycle (waiting for a lock held by a deadlocked thread) are
    not part of it: the cycle starts at its smallest thread ident so the answer is stable.
    """
    edges = wait_for_graph() if edges is None else edges
    out: dict[int, WaitEdge] = {}
    for e in edges:
        if e.holder is not None and e.holder != e.waiter:
            out.setdefault(e.waiter, e)
    done: set[int] = set()
    for start in out:
        path: list[int] = []
        on_path: dict[int, int] = {}
        t = start
        while t in out and t not in done and t not in on_path:
            on_path[t] = len(path)
            path.append(t)
            t = out[t].holder
        done.update(path)
        if t in on_path:                       # walked back onto this path: a cycle
            cyc = path[on_path[t]:]
            k = cyc.index(min(cyc))
            return [out[x] for x in cyc[k:] + cyc[:k]]
    return []


def describe_cycle(cycle: list[WaitEdge]) -> str:
    """'A' holds 'x' and waits for 'y' held by 'B', which ... : one line a human can act on."""
    if not cycle:
        return ""
    held_by = {e.holder: e.lock for e in cycle}          # what each thread in the cycle holds
    parts = [f"thread '{e.waiter_name}' holds '{held_by.get(e.waiter, '?')}' and waits for '{e.lock}' "
             f"(at {e.waiter_site}) held by '{e.holder_name}'" for e in cycle]
    return "; ".join(parts)


def lock_table(locks: list[InstrumentedLock] | None = None) -> list[dict]:
    """Who holds and who waits for each lock that is held or waited for right now."""
    now = time.perf_counter_ns()
    rows = []
    for lock in (all_locks() if locks is None else locks):
        holder, hname, hsite, since, waiters = _snapshot(lock)
        if holder is None and not waiters:
            continue
        rows.append({"lock": lock.name, "holder": hname, "holder_site": hsite,
                     "held_s": (now - since) / 1e9 if holder is not None else None,
                     "waiters": [{"thread": n, "site": s, "waited_s": (now - t0) / 1e9}
                                 for n, s, t0 in waiters.values()]})
    return rows
