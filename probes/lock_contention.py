"""lock_contention: how long threads wait for and hold each lock, and what that costs the step.

Listens to LockWaited / LockHeld (emitted by every InstrumentedLock on the engine's bus;
an uncontended acquire reports wait 0) and StepFinished. frame() has one row per
(lock, call site). Every `window` steps it compares the time the engine thread spent
waiting for each lock with the step time; a large share means other threads (stream
page-table updates, metrics readers) sit on the lock the step needs (field note 6), and
the finding names the lock and the call sites that held it the longest.

It also runs a Watchdog (workbench.watchdog): a step past `deadline_s` becomes a
critical finding here, with every thread's stack and the wait-for cycle if there is one.
The deadline is a hang detector's, generous by default: a long SmolLM2 prefill on a
busy 2-core host legitimately takes seconds.
"""
from __future__ import annotations

import threading
from collections import defaultdict, deque

import numpy as np

from workbench.events import LockHeld, LockWaited, StepFinished
from workbench.findings import SEVERITY_RANK
from workbench.probe import Probe

SHARD_HINT = "shard the page-table lock: EngineConfig(page_table_lock='sharded')"


class _Site:
    __slots__ = ("count", "contended", "stalls", "wait_max", "waits", "holds", "hold_count", "hold_total")

    def __init__(self, keep: int):
        self.count = self.contended = self.stalls = self.hold_count = 0
        self.wait_max = self.hold_total = 0
        self.waits: deque = deque(maxlen=keep)      # recent samples, for the percentiles
        self.holds: deque = deque(maxlen=keep)


class LockContentionProbe(Probe):
    name = "lock_contention"
    description = "lock wait / hold per lock and call site; engine wait share; watchdog for hung steps"

    def __init__(self, window: int = 8, warn_share: float = 0.10, error_share: float = 0.30,
                 min_wait_ms: float = 1.0, stall_ms: float = 50.0, keep: int = 4096,
                 watchdog: bool = True, deadline_s: float = 60.0, poll_s: float | None = None, **params):
        super().__init__(**params)
        self.window, self.warn_share, self.error_share = window, warn_share, error_share
        self.min_wait_ns = int(min_wait_ms * 1e6)
        self.stall_ns = int(stall_ms * 1e6)
        self.keep = keep
        self.use_watchdog, self.deadline_s, self.poll_s = watchdog, deadline_s, poll_s
        self.watchdog = None
        self._mu = threading.Lock()         # events arrive from every thread that takes a lock
        self._clear()

    def _clear(self) -> None:
        self.sites: dict[tuple[str, str], _Site] = {}
        self._pending: dict[tuple[str, str], int] = defaultdict(int)   # (thread, lock) -> wait ns this step
        self.engine_thread: str | None = None
        self.step_rows: list[dict] = []      # per step: duration and the engine thread's wait per lock
        self._win_start = 0                  # index in step_rows where the current window starts
        self._win_holds: dict[tuple[str, str, str], int] = defaultdict(int)   # (lock, thread, site) -> ns
        self._worst: dict[str, int] = {}     # lock -> rank of the loudest contention finding so far

    # ---- wiring ------------------------------------------------------------
    def on_attach(self, engine) -> None:
        self.listen(LockWaited, self._on_wait)
        self.listen(LockHeld, self._on_hold)
        self.listen(StepFinished, self._on_step)
        if self.use_watchdog:
            from workbench.watchdog import Watchdog
            self.watchdog = Watchdog(engine, self.deadline_s, self.poll_s, sink=self._from_watchdog,
                                     probe=self.name).start()

    def on_detach(self, engine) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        self._check(final=True)

    def _from_watchdog(self, f) -> None:
        if len(self.findings) < self.max_findings:
            self.findings.append(f)

    def _site(self, lock: str, site: str) -> _Site:
        s = self.sites.get((lock, site))
        if s is None:
            s = self.sites[(lock, site)] = _Site(self.keep)
        return s

    # ---- events ------------------------------------------------------------
    def _on_wait(self, e: LockWaited) -> None:
        w = e.wait_ns
        with self._mu:
            s = self._site(e.lock, e.site)
            s.count += 1
            s.waits.append(w)
            if w > 0:
                s.contended += 1
                self._pending[(e.thread, e.lock)] += w
                if w > s.wait_max:
                    s.wait_max = w
                if w > self.stall_ns:
                    s.stalls += 1

    def _on_hold(self, e: LockHeld) -> None:
        with self._mu:
            s = self._site(e.lock, e.site)
            s.hold_count += 1
            s.hold_total += e.hold_ns
            s.holds.append(e.hold_ns)
            self._win_holds[(e.lock, e.thread, e.site)] += e.hold_ns

    def _on_step(self, e: StepFinished) -> None:
        me = threading.current_thread().name        # StepFinished is emitted on the engine thread
        with self._mu:
            self.engine_thread = me
            waits = {lock: ns for (th, lock), ns in self._pending.items() if th == me}
            self._pending.clear()
            self.step_rows.append({"step": e.step, "duration_ns": e.duration_ns, "waits": waits})
            due = len(self.step_rows) - self._win_start >= self.window
        if due:
            self._check()

    # ---- analysis ----------------------------------------------------------
    def wait_share(self, lock: str | None = None, since: int = 0) -> float:
        """Engine-thread wait for `lock` (default: the engine's page-table lock) / step time."""
        lock = lock or self._table_lock_name()
        rows = self.step_rows[since:]
        total = sum(r["duration_ns"] for r in rows)
        return sum(r["waits"].get(lock, 0) for r in rows) / total if total else 0.0

    def _table_lock_name(self) -> str:
        eng = self.engine
        return eng.lock.name if eng is not None and hasattr(eng, "lock") else "page_table"

    def _check(self, final: bool = False) -> None:
        with self._mu:
            rows = self.step_rows[self._win_start:]
            holds = dict(self._win_holds)
            self._win_start = len(self.step_rows)
            self._win_holds.clear()
            me = self.engine_thread
        if not rows or (final and len(rows) < 2):
            return
        total = sum(r["duration_ns"] for r in rows)
        waited: dict[str, int] = defaultdict(int)
        for r in rows:
            for lock, ns in r["waits"].items():
                waited[lock] += ns
        table = self._table_lock_name()
        for lock, ns in waited.items():
            share = ns / total if total else 0.0
            if ns < self.min_wait_ns or share < self.warn_share:
                continue
            sev = "error" if share >= self.error_share else "warn"
            if SEVERITY_RANK[sev] <= self._worst.get(lock, -1):
                continue                     # said already, as loud or louder
            self._worst[lock] = SEVERITY_RANK[sev]
            others = sorted(((t, site, h) for (lk, t, site), h in holds.items() if lk == lock and t != me),
                            key=lambda x: -x[2])
            by_site: dict[str, int] = defaultdict(int)
            for _, site, h in others:
                by_site[site] += h
            top = sorted(by_site.items(), key=lambda x: -x[1])[:3]
            threads = sorted({t for t, _, _ in others})
            top_txt = ", ".join(f"{site} (held {h / 1e6:.0f} ms)" for site, h in top) or "none recorded"
            msg = (f"engine thread '{me}' spent {share:.0%} of step time (steps {rows[0]['step']}-"
                   f"{rows[-1]['step']}) waiting for lock '{lock}' ({ns / 1e6:.0f} ms of {total / 1e6:.0f} ms); "
                   f"top contending call sites: {top_txt}")
            hint = (SHARD_HINT if lock == table else
                    f"take slow work out of the '{lock}' critical section or split the lock per stream")
            self.report(sev, msg, hint, kind="lock-contention",
                        step=rows[-1]["step"], lock=lock,
                        evidence={"share": share, "wait_ms": ns / 1e6, "step_ms": total / 1e6,
                                  "steps": len(rows), "top_sites": [s for s, _ in top],
                                  "contending_threads": threads})

    # ---- views -------------------------------------------------------------
    def frame(self):
        """One row per (lock, call site): acquires, wait / hold percentiles (ms), contention, stalls."""
        import pandas as pd
        with self._mu:
            items = [(k, s.count, s.contended, s.stalls, s.wait_max, np.array(s.waits, dtype=np.int64),
                      np.array(s.holds, dtype=np.int64), s.hold_count, s.hold_total)
                     for k, s in self.sites.items()]
        rows = []
        for (lock, site), count, contended, stalls, wmax, waits, holds, hcount, htotal in items:
            def pct(a, q):
                return float(np.percentile(a, q)) / 1e6 if len(a) else float("nan")
            rows.append({"lock": lock, "site": site, "count": count, "contended": contended,
                         "contention_ratio": contended / count if count else 0.0,
                         "wait_p50_ms": pct(waits, 50), "wait_p99_ms": pct(waits, 99), "wait_max_ms": wmax / 1e6,
                         "hold_p50_ms": pct(holds, 50), "hold_p99_ms": pct(holds, 99),
                         "hold_total_ms": htotal / 1e6, "stalls": stalls})
        cols = ["lock", "site", "count", "contended", "contention_ratio", "wait_p50_ms", "wait_p99_ms",
                "wait_max_ms", "hold_p50_ms", "hold_p99_ms", "hold_total_ms", "stalls"]
        df = pd.DataFrame(rows, columns=cols)
        return df.sort_values(["lock", "hold_total_ms"], ascending=[True, False]).reset_index(drop=True)

    def steps_frame(self):
        """One row per step: duration and the engine thread's wait for each lock (ms)."""
        import pandas as pd
        with self._mu:
            rows = list(self.step_rows)
        locks = sorted({lk for r in rows for lk in r["waits"]})
        return pd.DataFrame([{"step": r["step"], "duration_ms": r["duration_ns"] / 1e6,
                              **{f"wait_{lk}_ms": r["waits"].get(lk, 0) / 1e6 for lk in locks}} for r in rows])

    def widget(self):
        import plotly.express as px
        df = self.frame()
        if df.empty:
            return px.bar(title=f"{self.name}: no lock events yet")
        df = df.assign(label=df["lock"] + " @ " + df["site"])
        return px.bar(df, x="hold_total_ms", y="label", color="contention_ratio", orientation="h",
                      hover_data=["count", "wait_p99_ms", "hold_p99_ms", "stalls"],
                      title="lock hold time by call site (colour: contention ratio)")

    def reset(self) -> None:
        super().reset()
        with self._mu:
            self._clear()
        if self.watchdog is not None:
            self.watchdog.findings.clear()
