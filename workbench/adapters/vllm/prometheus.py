"""The watched vLLM's plugin state as Prometheus metrics, read at scrape time from a VllmConnection.

  kvwb_vllm_check_active{check}          1 while the plugin says the check runs, 0 when it says it
                                         does not (its status line says why); absent until heard
  kvwb_vllm_steps_checked_total          engine steps the pool check reported
  kvwb_findings_total{probe,severity}    the plugin's findings (vllm_pool, vllm_metadata), zeros
                                         included so alert rules see the series before the first

    server = conn.serve_metrics(port=0)      # 127.0.0.1; server.url
"""
from __future__ import annotations

from collections import Counter
from typing import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...findings import SEVERITIES

PLUGIN_PROBES = ("vllm_pool", "vllm_metadata")


class VllmCollector(Collector):
    def __init__(self, conn):
        self.conn = conn

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(True))

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(False))

    def _families(self, live: bool) -> list[Metric]:
        active = GaugeMetricFamily("kvwb_vllm_check_active",
                                   "1 if the vLLM plugin's check runs on this vLLM's step path, 0 if not "
                                   "(see its status line)", labels=["check"])
        steps = CounterMetricFamily("kvwb_vllm_steps_checked", "Engine steps the vLLM plugin's pool check reported.")
        found = CounterMetricFamily("kvwb_findings", "Findings reported by the Workbench's probes.",
                                    labels=["probe", "severity"])
        san = self.conn.sanitizer
        if live and san is not None:
            with san.lock:
                statuses = dict(san.statuses)
                n = len(san.steps)
                counts = Counter((f.probe, f.severity) for f in san.findings)
            for check, st in sorted(statuses.items()):
                active.add_metric([check], 1.0 if st.get("active") else 0.0)
            steps.add_metric([], n)
            for probe in sorted(set(PLUGIN_PROBES) | {p for p, _ in counts}):
                for sev in SEVERITIES:
                    found.add_metric([probe, sev], counts.get((probe, sev), 0))
        return [active, steps, found]
