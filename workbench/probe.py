"""Probe: the base every probe in the `probes` package builds on.

A probe subscribes to engine events (and may read live engine state), keeps its own
measurements as rows for frame(), and reports Findings. It never raises into the
engine: every callback it registers through listen() is wrapped, and an exception
becomes a `probe-error` finding while the engine carries on.
"""
from __future__ import annotations

import traceback
from time import perf_counter_ns
from typing import Any, Callable, Iterable

from .findings import Finding, findings_frame


class Probe:
    name = "probe"
    description = ""

    def __init__(self, **params: Any):
        self.params = params
        self.engine = None
        self.findings: list[Finding] = []
        self.rows: list[dict] = []
        self._subs: list[tuple[Any, Callable]] = []
        self.max_findings = params.get("max_findings", 1000)
        self._seen: set = set()          # dedup keys of reported findings
        self.cost_ns = 0                 # time spent in this probe's callbacks (guard())
        self.calls = 0

    # ---- lifecycle ---------------------------------------------------------
    def attach(self, engine) -> "Probe":
        if self.engine is not None:
            raise RuntimeError(f"probe {self.name} is already attached")
        self.engine = engine
        self.on_attach(engine)
        return self

    def detach(self) -> None:
        if self.engine is None:
            return
        self.on_detach(self.engine)
        for bus, fn in self._subs:
            bus.unsubscribe(fn)
        self._subs.clear()
        self.engine = None

    def on_attach(self, engine) -> None:
        """Subscribe here, with self.listen(types, fn)."""

    def on_detach(self, engine) -> None:
        pass

    def listen(self, etypes: type | Iterable[type], fn: Callable) -> None:
        bus = self.engine.bus
        safe = self.guard(fn)
        bus.subscribe(etypes, safe)
        self._subs.append((bus, safe))

    def guard(self, fn: Callable) -> Callable:
        """fn, but an exception in it becomes a probe-error finding instead of propagating.

        The time spent in it is added to cost_ns: every probe reports what it costs the
        engine thread (Workbench.costs()), measured where it is spent."""
        def safe(*a, **kw):
            t0 = perf_counter_ns()
            try:
                return fn(*a, **kw)
            except Exception as e:            # noqa: BLE001 - a probe must never break the engine
                self.probe_error(e)
            finally:
                self.cost_ns += perf_counter_ns() - t0
                self.calls += 1
        safe.__wrapped__ = fn
        return safe

    def probe_error(self, e: BaseException) -> None:
        step = getattr(self.engine, "step_count", None)
        self.report("error", f"probe {self.name} failed: {type(e).__name__}: {e}", kind="probe-error",
                    hint="a bug in the probe, not in the engine; the engine carried on",
                    step=step, evidence={"traceback": traceback.format_exc(limit=6)},
                    dedup=("probe-error", type(e).__name__, str(e)))

    # ---- findings ------------------------------------------------------------
    def report(self, severity: str, message: str, hint: str = "", kind: str = "", dedup: Any = None,
               **fields: Any) -> Finding | None:
        """Record a finding; with a dedup key, only the first finding of that key is kept."""
        if dedup is not None:
            if dedup in self._seen:
                return None
            self._seen.add(dedup)
        if len(self.findings) >= self.max_findings:
            return None
        f = Finding(self.name, severity, message, hint, kind or self.name, **fields)
        self.findings.append(f)
        rec = getattr(self.engine, "recorder", None)
        if rec is not None:                  # the flight recorder keeps it; one >= error freezes a bundle
            rec.note_finding(f)
        return f

    def findings_frame(self):
        return findings_frame(self.findings)

    def frame(self):
        """The probe's measurements, one row per observation (a pandas DataFrame)."""
        import pandas as pd
        return pd.DataFrame(self.rows)

    def widget(self):
        """A view of this probe (a plotly figure by default)."""
        df = self.frame()
        import plotly.express as px
        if df.empty or "step" not in df:
            return px.scatter(title=f"{self.name}: no data yet")
        num = [c for c in df.columns if c != "step" and df[c].dtype.kind in "if"]
        return px.line(df, x="step", y=num[:4], title=self.name)

    def reset(self) -> None:
        self.findings.clear()
        self.rows.clear()
        self._seen.clear()
