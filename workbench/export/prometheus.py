"""Prometheus export: live engine and pool state, read at scrape time.

A custom collector, not a set of Gauges updated by the engine: nothing is wired into
the step loop, and every scrape reads engine.stats() once (under the page-table lock,
so one scrape is one consistent snapshot) plus the Workbench's findings. It serves
on a private CollectorRegistry, so two engines in one process export side by side
and the process-global registry stays untouched.

Metric names are a contract (dashboards and alerts.yml use them); vLLM's names
(vllm:kv_cache_usage_perc, vllm:num_preemptions, prefix_cache_queries/hits) are the
model. Prefix-cache queries and hits count prompt tokens, as vLLM counts them.
"""
from __future__ import annotations

import threading
from collections import Counter
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily,
                                            Metric)
from prometheus_client.registry import Collector

from ..findings import SEVERITIES

# (stats key, metric name without the _total suffix, help): counters from engine.stats()
_COUNTERS = (
    ("num_preemptions", "kvwb_num_preemptions", "Requests preempted (pages taken back, recomputed later)."),
    ("prefix_cache_queries", "kvwb_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "kvwb_prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("num_evictions", "kvwb_page_evictions", "Cached free pages handed out again (their prefix hash lost)."),
    ("steps", "kvwb_steps", "Engine steps taken."),
)
# (stats key, metric name, help): gauges from engine.stats()
_GAUGES = (
    ("pages_used", "kvwb_pages_used", "KV pages held by live sequences."),
    ("pages_total", "kvwb_pages_total", "KV pages in the pool."),
    ("pages_cached", "kvwb_pages_cached", "Free KV pages that still carry a prefix hash (reusable)."),
    ("pages_free", "kvwb_pages_free", "Free KV pages, cached ones included."),
    ("num_running", "kvwb_num_running", "Sequences in the running queue."),
    ("num_waiting", "kvwb_num_waiting", "Sequences waiting for admission."),
)
METRIC_NAMES = frozenset(
    ["kvwb_kv_cache_usage_ratio", "kvwb_findings_total", "kvwb_page_size_tokens", "kvwb_kv_cache_bytes",
     "kvwb_kv_cache_used_bytes", "kvwb_engine_info"]
    + [name + "_total" for _, name, _ in _COUNTERS] + [name for _, name, _ in _GAUGES])


def _split(target: Any) -> tuple[Any, Any]:
    """(engine, workbench or None) from an Engine or a Workbench."""
    if hasattr(target, "all_findings") and hasattr(target, "engine"):
        return target.engine, target
    if hasattr(target, "stats") and hasattr(target, "pool"):
        return target, None
    raise TypeError(f"serve an Engine or a Workbench, not {type(target).__name__}")


class EngineCollector(Collector):
    """Yields the kvwb_* metric families from the live engine (and Workbench) on each collect()."""

    def __init__(self, engine_or_workbench: Any):
        self.engine, self.workbench = _split(engine_or_workbench)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self.engine.stats()))

    def describe(self) -> Iterator[Metric]:
        # Names only (for the registry's duplicate check); no scrape of the engine.
        return iter(self._families(None))

    def _families(self, st: dict | None) -> list[Metric]:
        eng = self.engine
        out: list[Metric] = []
        usage = GaugeMetricFamily("kvwb_kv_cache_usage_ratio",
                                  "KV pages in use / pages in the pool (alert above 0.95).")
        if st is not None:
            usage.add_metric([], st["pages_used"] / st["pages_total"])
        out.append(usage)
        for key, name, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc)
            if st is not None:
                g.add_metric([], st[key])
            out.append(g)
        for key, name, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc)
            if st is not None:
                c.add_metric([], st[key])
            out.append(c)
        out.append(self._findings(st is not None))
        # Sizing facts: the start-up log line of field note 13, as metrics.
        page_bytes = eng.kv.bytes_per_page
        static = (("kvwb_page_size_tokens", "Tokens per KV page.", eng.config.page_size),
                  ("kvwb_kv_cache_bytes", "Bytes of the whole KV pool (K and V, all layers).",
                   page_bytes * eng.num_pages))
        for name, doc, value in static:
            out.append(GaugeMetricFamily(name, doc, value=value) if st is not None
                       else GaugeMetricFamily(name, doc))
        used = GaugeMetricFamily("kvwb_kv_cache_used_bytes", "Bytes of the KV pool held by live sequences.")
        if st is not None:
            used.add_metric([], st["pages_used"] * page_bytes)
        out.append(used)
        info = InfoMetricFamily("kvwb_engine", "Engine configuration.")
        if st is not None:
            info.add_metric([], {"model": str(eng.source), "device": str(eng.device),
                                 "dtype": str(eng.dtype).removeprefix("torch."),
                                 "kv_dtype": str(eng.kv_dtype).removeprefix("torch."),
                                 "prefix_caching": str(eng.config.enable_prefix_caching).lower()})
        out.append(info)
        return out

    def _findings(self, live: bool) -> CounterMetricFamily:
        fam = CounterMetricFamily("kvwb_findings", "Findings reported by the Workbench's probes.",
                                  labels=["probe", "severity"])
        wb = self.workbench
        if not live or wb is None:
            return fam
        counts = Counter((f.probe, f.severity) for f in wb.all_findings())
        # Every attached probe gets all severities, zeros included: increase() and absent()
        # in alert rules need the series to exist before the first finding.
        probes = {p.name for p in list(wb.probes.values())} | {p for p, _ in counts}
        for probe in sorted(probes):
            for sev in SEVERITIES:
                fam.add_metric([probe, sev], counts.get((probe, sev), 0))
        return fam


class MetricsServer:
    """A running /metrics endpoint: .port, .addr, .url, .registry; stop() or use as a context manager."""

    def __init__(self, engine_or_workbench: Any, port: int = 0, addr: str = "127.0.0.1",
                 collector: Collector | None = None):
        self.registry = CollectorRegistry()
        self.collector = collector or EngineCollector(engine_or_workbench)
        self.registry.register(self.collector)
        self._httpd, self._thread = start_http_server(port, addr, registry=self.registry)
        self._thread.name = f"kvwb-metrics:{self._httpd.server_port}"
        self.addr = self._httpd.server_address[0]
        self.port = self._httpd.server_port
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and close the listening socket (the port is free afterwards). Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped.is_set() else "serving"
        return f"<MetricsServer {self.url} {state}>"


def serve_metrics(engine_or_workbench: Any, port: int = 0, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve kvwb_* metrics over HTTP on a private registry; port 0 picks a free port.

    Binds loopback by default: expose it wider (addr="0.0.0.0") only on purpose.
    """
    return MetricsServer(engine_or_workbench, port, addr)


def alerts_path() -> Path:
    """The shipped Prometheus rule file (alerts.yml)."""
    return Path(str(resources.files(__package__).joinpath("alerts.yml")))
