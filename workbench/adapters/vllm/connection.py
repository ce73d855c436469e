"""VllmConnection: one running vLLM, seen through its three doors, for the workbench's views.

  /metrics     MetricsScraper: usage, running / waiting, preemptions, prefix-cache counters
  KV events    KVEventSubscriber: the prefix-cache blocks vLLM stored and has not removed
  sanitizer    SanitizerListener: the plugin's findings, pool snapshots and step times

Any door may be left out (None). Problems (a wrong URL, a vLLM without KV events, a dropped
connection, a malformed message) become sentences in problems(), never exceptions, and
every view keeps the last good state.
"""
from __future__ import annotations

import time

from ...events import (EventBus, VllmBlocksRemoved, VllmBlocksStored, VllmMetricsScraped, VllmStepChecked)
from .kv_events import BlockRemoved, BlockStored, KVEventSubscriber
from .listener import SanitizerListener
from .metrics import MetricsScraper


class VllmConnection:
    def __init__(self, url: str | None = "http://127.0.0.1:8000", kv_events: str | None = None,
                 sanitizer: str | None = None, kv_replay: str | None = None, interval_s: float = 1.0,
                 bus: EventBus | None = None):
        self.url = url
        # What the three doors see also travels as typed events, so an EventLog on this bus keeps
        # the watched vLLM's history as DataFrames (wb.log.frame("VllmStepChecked"), ...).
        self.bus = bus or EventBus()          # subscribe before the doors open (pass bus=) to miss nothing
        self.kv = self.metrics = None
        self.sanitizer = SanitizerListener(sanitizer, on_step=self._on_step) if sanitizer else None
        try:
            if kv_events:                    # KVEventSubscriber binds only loopback addresses itself
                self.kv = KVEventSubscriber(kv_events, kv_replay, on_batch=self._on_batch).start()
            if url:
                self.metrics = MetricsScraper(url, interval_s=interval_s, on_row=self._on_row).start()
        except Exception:
            self.close()
            raise
        self.started = time.time()

    # ---- events --------------------------------------------------------------------------
    def _on_step(self, row: dict) -> None:
        if self.bus.wants(VllmStepChecked):
            # a row may lack its timings (the idle sweep's has no step time; an older plugin's may have
            # none): the step is still on the timelines, its times None
            self.bus.emit(VllmStepChecked(int(row["step"]), int(row["t"] * 1e9), int(row["num_blocks"]),
                                          int(row["num_free"]), int(row["running"]), int(row["waiting"]),
                                          int(row.get("hashed") or 0), _ns(row.get("step_s")),
                                          _ns(row.get("check_s"))))

    def _on_batch(self, batch) -> None:
        t = int(batch.ts * 1e9)
        for e in batch.events:
            if isinstance(e, BlockStored) and self.bus.wants(VllmBlocksStored):
                self.bus.emit(VllmBlocksStored(batch.seq, t, tuple(e.block_hashes), len(e.token_ids)))
            elif isinstance(e, BlockRemoved) and self.bus.wants(VllmBlocksRemoved):
                self.bus.emit(VllmBlocksRemoved(batch.seq, t, tuple(e.block_hashes)))

    def _on_row(self, index: int, r: dict) -> None:
        if self.bus.wants(VllmMetricsScraped):
            self.bus.emit(VllmMetricsScraped(index, int(r["t"] * 1e9), r.get("kv_cache_usage"), r.get("running"),
                                             r.get("waiting"), r.get("preemptions"), r.get("prefix_queries"),
                                             r.get("prefix_hits")))

    # ---- what the views read ------------------------------------------------------------
    @property
    def findings(self) -> list:
        return list(self.sanitizer.findings) if self.sanitizer else []

    @property
    def pool(self):
        """The latest pool snapshot from the plugin (a PoolState), or None."""
        return self.sanitizer.pool if self.sanitizer else None

    def usage(self) -> float | None:
        """KV-cache usage as vLLM defines it (1 - free / usable blocks), from the latest snapshot."""
        s = self.sanitizer.steps[-1] if self.sanitizer and self.sanitizer.steps else None
        if not s or not s.get("num_blocks"):
            return None
        return 1.0 - s["num_free"] / max(1, s["num_blocks"] - 1)      # block 0 is vLLM's null block

    def checks(self) -> list[dict]:
        """The plugin's checks as it reported them: {check, active, via, path, reason} each."""
        if self.sanitizer is None:
            return []
        with self.sanitizer.lock:
            return [dict(v) for _, v in sorted(self.sanitizer.statuses.items())]

    def checks_line(self) -> str:
        cs = self.checks()
        if not cs:
            return "plugin checks: not heard yet"
        return "plugin checks: " + " | ".join(
            f"{c['check']} {'on' if c.get('active') else 'OFF'}" + (f" ({c['path']})" if c.get("path") else "")
            for c in cs)

    def serve_metrics(self, port: int = 0, addr: str = "127.0.0.1"):
        """kvwb_vllm_check_active{check} and the plugin's findings over HTTP (prometheus.py)."""
        from ...export.prometheus import MetricsServer
        from .prometheus import VllmCollector
        return MetricsServer(None, port, addr, collector=VllmCollector(self))

    def problems(self) -> list[str]:
        out = [f"plugin: {c['check']} is NOT active: {c.get('reason')}" for c in self.checks() if not c.get("active")]
        if self.metrics is not None and self.metrics.failing:     # past failures that recovered are not news
            out.append(f"/metrics: {self.metrics.failing}")
        if self.kv is not None:
            out += [f"KV events: {e}" for e in self.kv.errors[-3:]]
            if self.kv.last_batch_time is None and time.time() - self.started > 10:
                out.append("KV events: nothing received yet; is vLLM started with --kv-events-config "
                           "'{\"enable_kv_cache_events\": true, ...}' publishing to this address?")
        if self.sanitizer is not None:
            out += [f"sanitizer: {e}" for e in self.sanitizer.errors[-3:]]
            if not self.sanitizer.messages and time.time() - self.started > 10:
                out.append(f"sanitizer: nothing received on {self.sanitizer.address}; is vLLM started with "
                           f"PAGEDKV_VLLM_SANITIZER={self.sanitizer.address} and the workbench installed in "
                           f"its environment?")
        return out

    def summary(self) -> dict:
        """One line's worth: the latest metrics, the pool, the KV-event map, the findings."""
        row = dict(self.metrics.rows[-1]) if self.metrics is not None and self.metrics.rows else {}
        st = self.sanitizer.steps[-1] if self.sanitizer and self.sanitizer.steps else {}
        row.update({"step": st.get("step"), "blocks": st.get("num_blocks"), "blocks_free": st.get("num_free"),
                    "stored_blocks": len(self.kv.stored) if self.kv is not None else None,
                    "findings": len(self.findings),
                    "errors": sum(f.at_least("error") for f in self.findings)})
        return row

    def summary_line(self) -> str:
        s = self.summary()

        def f(v, fmt="{}"):
            return "-" if v is None else fmt.format(v)
        return (f"vLLM {self.url}: usage {f(s.get('kv_cache_usage'), '{:.1%}')} | running {f(s.get('running'), '{:.0f}')}"
                f" waiting {f(s.get('waiting'), '{:.0f}')} | preemptions {f(s.get('preemptions'), '{:.0f}')} | "
                f"step {f(s.get('step'))} free {f(s.get('blocks_free'))}/{f(s.get('blocks'))} | "
                f"KV-event blocks {f(s.get('stored_blocks'))} | findings {s['findings']} ({s['errors']} >= error)")

    def wait_idle(self, timeout_s: float = 30) -> dict:
        """Until the plugin's latest snapshot shows nothing running or waiting (that snapshot)."""
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            st = self.sanitizer.steps[-1] if self.sanitizer and self.sanitizer.steps else None
            if st and st["running"] == 0 and st["waiting"] == 0 and time.time() - st["t"] > 0.5:
                return st
            time.sleep(0.2)
        raise TimeoutError(f"vLLM not idle after {timeout_s:.0f} s: {self.summary_line()}")

    def steps_frame(self):
        import pandas as pd
        return pd.DataFrame(list(self.sanitizer.steps) if self.sanitizer else [])

    def metrics_frame(self):
        import pandas as pd
        return self.metrics.frame() if self.metrics is not None else pd.DataFrame()

    def close(self) -> None:
        for part in ("metrics", "kv", "sanitizer"):
            obj = getattr(self, part, None)
            if obj is not None:
                obj.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _ns(seconds) -> int | None:
    return None if seconds is None else int(seconds * 1e9)
