"""Export: the Prometheus endpoint and its alert rules, Chrome/Perfetto traces, HTML reports."""
from .chrome_trace import merge_into, to_chrome_trace, write_chrome_trace
from .prometheus import METRIC_NAMES, EngineCollector, MetricsServer, alerts_path, serve_metrics
from .report import write_html_report

__all__ = ["METRIC_NAMES", "EngineCollector", "MetricsServer", "alerts_path", "merge_into", "serve_metrics",
           "to_chrome_trace", "write_chrome_trace", "write_html_report"]
