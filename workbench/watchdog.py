"""Watchdog: notices an engine step that runs past its deadline and says why.

A daemon thread polls the engine's heartbeat (engine.step_started_ns, step_thread_id,
set at the top of Engine.step). When the step in flight is older than the deadline it
takes one snapshot of the process: every thread's stack (sys._current_frames), who
holds and who waits for each InstrumentedLock, the wait-for graph and its cycle if
there is one, and reports it as one `critical` finding per stuck step. Polling costs
two attribute reads; the expensive snapshot is taken only for a stuck step.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Callable

from .engine.engine import Engine
from .findings import Finding
from .locks import describe_cycle, find_cycle, lock_table, wait_for_graph

_STEP_CODE = Engine.step.__code__


def thread_stacks(limit: int = 40) -> dict[str, str]:
    """'name (ident)' -> formatted stack of every live thread."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {f"{names.get(ident, '?')} ({ident})": "".join(traceback.format_stack(frame, limit=limit))
            for ident, frame in sys._current_frames().items()}


def _where(ident: int | None) -> str:
    """file:line function of a thread's innermost frame outside the threading machinery."""
    f = sys._current_frames().get(ident) if ident is not None else None
    skip = (threading.__file__, __file__.replace("watchdog.py", "locks.py"))
    while f is not None and f.f_code.co_filename in skip:
        f = f.f_back
    return f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno} {f.f_code.co_name}" if f else "?"


def _in_step(ident: int, engine) -> bool:
    """Is thread `ident` inside `engine`'s Engine.step right now (also when step is wrapped)? Another
    engine's step on the same thread is not this one's: a notebook that drives two engines from one
    thread leaves the first one's last step start behind while the second one steps."""
    f = sys._current_frames().get(ident)
    while f is not None:
        if f.f_code is _STEP_CODE and f.f_locals.get("self") is engine:
            return True
        f = f.f_back
    return False


class Watchdog:
    """Watchdog(engine, deadline_s=5).start(); findings go to .findings and to sink(finding)."""

    name = "watchdog"

    def __init__(self, engine, deadline_s: float = 60.0, poll_s: float | None = None,
                 sink: Callable[[Finding], None] | None = None, probe: str = "watchdog"):
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.engine = engine
        self.deadline_s = deadline_s
        self.poll_s = poll_s if poll_s is not None else min(0.25, deadline_s / 4)
        self.sink = sink
        self.probe = probe
        self.findings: list[Finding] = []
        self._reported: set[int] = set()          # steps already reported as stuck
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------
    def start(self) -> "Watchdog":
        if self.thread is not None and self.thread.is_alive():
            return self
        self._stop.clear()
        # A daemon: the watchdog must never be what keeps a hung process alive.
        self.thread = threading.Thread(target=self._run, name=f"kvwb-watchdog-{id(self.engine):x}", daemon=True)
        self.thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        t = self.thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        self.thread = None

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception as e:                # noqa: BLE001 - the watchdog must outlive its own bugs
                self._emit(Finding(self.probe, "error", f"watchdog failed: {type(e).__name__}: {e}",
                                   "a bug in the watchdog, not in the engine", kind="probe-error",
                                   evidence={"traceback": traceback.format_exc(limit=6)}))

    # ---- one poll ----------------------------------------------------------
    def check(self) -> Finding | None:
        """Report the step in flight if it is past its deadline (once per step)."""
        eng = self.engine
        # step() stores the start time before it bumps step_count: read the count on both
        # sides so a start time from the previous (long finished) step is never used.
        step = eng.step_count
        ident, started = eng.step_thread_id, eng.step_started_ns
        if ident is None or step != eng.step_count or step in self._reported:
            return None
        elapsed = (time.perf_counter_ns() - started) / 1e9
        if elapsed <= self.deadline_s or not _in_step(ident, eng):
            return None
        self._reported.add(step)
        f = self.diagnose(step, ident, elapsed)
        self._emit(f)
        return f

    def _emit(self, f: Finding) -> None:
        self.findings.append(f)
        if self.sink is not None:
            self.sink(f)

    def diagnose(self, step: int, ident: int, elapsed: float) -> Finding:
        edges = wait_for_graph()
        cycle = find_cycle(edges)
        if not cycle:                    # an edge can blink while a lock changes hands: look twice
            time.sleep(0.01)
            edges = wait_for_graph()
            cycle = find_cycle(edges)
        names = {t.ident: t.name for t in threading.enumerate()}
        me = names.get(ident, str(ident))
        mine = next((e for e in edges if e.waiter == ident), None)
        msg = f"step {step} has run {elapsed:.1f} s, past its {self.deadline_s:g} s deadline, on thread '{me}'"
        lock = None
        if mine is not None:
            lock = mine.lock
            where = (f"acquired at {mine.holder_site}" if mine.holder_site
                     else f"now at {_where(mine.holder)}")     # sites are recorded only while timed
            msg += (f": it waits for lock '{mine.lock}' (at {mine.waiter_site}) held by "
                    f"'{mine.holder_name}' ({where}, held {mine.held_s or 0:.1f} s)")
        if cycle:
            locks = sorted({e.lock for e in cycle})
            lock = lock or cycle[0].lock
            msg += f". Deadlock, wait-for cycle over locks {locks}: {describe_cycle(cycle)}"
            hint = (f"lock-order inversion: take {' and '.join(repr(x) for x in locks)} in one global order "
                    f"in every thread (or acquire with a timeout and back off); see the stacks in evidence")
        elif mine is not None:
            hint = (f"'{mine.holder_name}' does not release '{mine.lock}': read its stack in evidence; keep "
                    f"slow work (device syncs, I/O) out of the critical section or shard the lock")
        else:
            hint = f"the engine thread waits for no instrumented lock: read its stack in evidence ('{me}')"
        evidence = {
            "elapsed_s": elapsed, "deadline_s": self.deadline_s, "engine_thread": me,
            "cycle": [e.to_dict() for e in cycle],
            "cycle_threads": [e.waiter_name for e in cycle],
            "cycle_locks": [e.lock for e in cycle],
            "wait_for": [e.to_dict() for e in edges],
            "locks": lock_table(),
            "stacks": thread_stacks(),
        }
        return Finding(self.probe, "critical", msg, hint, kind="deadlock" if cycle else "step-stalled",
                       step=step, lock=lock, evidence=evidence)
