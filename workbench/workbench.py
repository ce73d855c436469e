"""Workbench: the facade over an engine, its event log and its probes.

Like Holistic Trace Analysis: a thin front over the analyzers, every answer a
DataFrame first (wb.findings, wb.probe(name).frame()), a figure on request.
"""
from __future__ import annotations

from collections import deque
from typing import Any

from .event_log import EventLog
from .events import StepFinished
from .findings import SEVERITY_RANK, Finding, findings_frame


class Workbench:
    def __init__(self, engine, log: bool = True, max_log_rows: int = 1_000_000, spill_dir: str | None = None):
        self.engine = engine
        self.probes: dict[str, Any] = {}
        self.vllm = None                     # a VllmConnection, when the engine watched is a running vLLM
        bus = engine.bus if engine is not None else None
        self.log = EventLog(bus, max_rows=max_log_rows, spill_dir=spill_dir) if log else None
        # each step's StepRecord summary (rows, tokens, ns per phase, pool counters), kept with the log
        self._steps: deque = deque(maxlen=max_log_rows)
        self._steps_sub = None
        if log and engine is not None and hasattr(engine, "step_record"):
            self._steps_sub = self._keep_step
            bus.subscribe(StepFinished, self._steps_sub)

    @classmethod
    def connect_vllm(cls, url: str = "http://127.0.0.1:8000", kv_events: str | None = "tcp://127.0.0.1:5557",
                     sanitizer: str | None = "tcp://127.0.0.1:5590", kv_replay: str | None = None,
                     interval_s: float = 1.0) -> "Workbench":
        """Watch a running vLLM: its /metrics at url, its KV events (vLLM's --kv-events-config
        endpoint; the workbench binds it when vLLM connects, as for tcp://127.0.0.1:PORT), and the
        findings of the workbench's vLLM plugin (vLLM started with PAGEDKV_VLLM_SANITIZER=<sanitizer>;
        the workbench binds it). None leaves a door out. wb.dashboard() then shows vLLM's pool."""
        from .adapters.vllm.connection import VllmConnection
        from .events import EventBus
        wb = cls(None, log=False)
        bus = EventBus()
        wb.log = EventLog(bus, max_rows=1_000_000)     # the watched vLLM's history, as DataFrames, from the start
        wb.vllm = VllmConnection(url, kv_events, sanitizer, kv_replay, interval_s, bus=bus)
        return wb

    def close(self) -> None:
        """Detach the probes and close a vLLM connection (its sockets and threads)."""
        self.detach()
        if self._steps_sub is not None:
            self.engine.bus.unsubscribe(self._steps_sub)
            self._steps_sub = None
        if self.vllm is not None:
            self.vllm.close()

    @classmethod
    def default(cls, config=None, **kw) -> "Workbench":
        from .engine import Engine, EngineConfig
        return cls(Engine.from_default(config or EngineConfig()), **kw)

    @staticmethod
    def open(path, strict: bool = False):
        """A flight recording or repro bundle (workbench/recorder/), even one a killed process left:
        .requests, .findings, .frame(), .time_travel() (the recorded pool at any step), .trace(),
        .replay() with the recorded settings and .compare() of the two."""
        from .recorder.reader import open_recording
        return open_recording(path, strict=strict)

    def attach(self, *names: str, **params: Any) -> "Workbench":
        """Attach probes by name (all of them when none is named). params: {name: {...}} per probe."""
        import probes as registry
        wanted = [n for n in (names or registry.available()) if n not in self.probes]
        unknown = set(params) - set(registry.PROBES)
        if unknown:
            raise KeyError(f"parameters for unknown probes {sorted(unknown)}; probes: {', '.join(registry.PROBES)}")
        classes = {n: registry.probe_class(n) for n in wanted}     # every import first: all or nothing
        for name, cls in classes.items():
            probe = self.probes[name] = cls(**params.get(name, {})).attach(self.engine)
            probe.cost_ns = probe.calls = 0      # costs() counts the run, not one-off set-up at attach
        return self

    def detach(self, *names: str) -> None:
        for name in names or list(self.probes):
            p = self.probes.pop(name, None)
            if p is not None:
                p.detach()

    def probe(self, name: str):
        if name not in self.probes:
            raise KeyError(f"probe {name!r} is not attached; attached: {', '.join(self.probes) or 'none'}")
        return self.probes[name]

    def all_findings(self) -> list[Finding]:
        out = [f for p in self.probes.values() for f in p.findings]
        if self.vllm is not None:
            out += self.vllm.findings
        return sorted(out, key=lambda f: (f.step if f.step is not None else -1, f.time))

    @property
    def findings(self):
        """Every probe's findings as one DataFrame (probe, severity, step, request_id, layer, page, ...)."""
        return findings_frame(self.all_findings())

    def _keep_step(self, e) -> None:
        rec = self.engine.step_record
        if rec is not None and rec.step == e.step:
            self._steps.append(rec.summary())

    def steps(self):
        """One row per engine step from its StepRecord: rows and tokens, the nanoseconds spent to
        schedule, prepare, execute (forward + sampling) and update, and the pool's free pages before
        and after (a pandas DataFrame; kept while the Workbench logs)."""
        import pandas as pd
        cols = ["step", "source", "rows", "tokens", "schedule_ns", "prepare_ns", "execute_ns", "update_ns",
                "free_before", "free_after", "cached_free_after"]
        return pd.DataFrame(list(self._steps), columns=cols)

    def findings_at_least(self, severity: str) -> list[Finding]:
        return [f for f in self.all_findings() if SEVERITY_RANK[f.severity] >= SEVERITY_RANK[severity]]

    def capture(self, path: str, append: bool = False):
        """Record every request the engine accepts from now on into a JSONL trace (crash-safe)."""
        from .trace.capture import TraceCapture
        return TraceCapture(self.engine, path, append=append)

    def costs(self):
        """What each attached probe cost the engine: callbacks run and seconds spent in them."""
        import pandas as pd
        rows = [{"probe": n, "calls": p.calls, "seconds": p.cost_ns / 1e9} for n, p in self.probes.items()]
        return pd.DataFrame(rows, columns=["probe", "calls", "seconds"])

    def reset(self) -> None:
        for p in self.probes.values():
            p.reset()

    def run(self, prompts, params=None, progress: bool = False):
        """engine.generate with the probes watching; returns the outputs."""
        return self.engine.generate(prompts, params, progress=progress)

    def dashboard(self, live: bool = True, **kw):
        """Page map, timelines and findings on one step cursor: live while the engine runs
        (throttled to 10 Hz), a time-travel view (Play + step slider) over the log after."""
        if self.vllm is not None:
            from .widgets.vllm_dashboard import VllmDashboard
            return VllmDashboard(self.vllm, **kw)
        from .widgets.dashboard import Dashboard
        return Dashboard.from_workbench(self, live=live, **kw)

    def export_html(self, path: str, **kw) -> str:
        """The dashboard's views as one self-contained HTML file (no CDN), for an incident ticket."""
        dash = self.dashboard(live=False)
        try:
            return dash.to_html(path, **kw)
        finally:
            dash.close()
