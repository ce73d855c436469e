"""VllmDashboard: a running vLLM's pool, timelines and findings, live from a VllmConnection.

The same page map as our engine's dashboard (one byte per block: free, cached-free, owned,
shared, a hue per request), fed by the plugin's per-step snapshots; the timelines come from
vLLM's own /metrics; the findings from the plugin's checks. A background thread refreshes
it every `interval_s` (only what changed is sent to the browser); problems with any of the
three doors show as a line in red above it, and every part keeps its last good state.
"""
from __future__ import annotations

import html
import threading

import ipywidgets as W

from ..findings import findings_frame
from .findings_table import FindingsTable, pages_named
from .page_map import PageMap

TIMELINES = (("kv_cache_usage", "KV-cache usage"), ("running", "running"), ("waiting", "waiting"),
             ("preemptions", "preemptions (total)"))


class VllmDashboard:
    def __init__(self, conn, interval_s: float = 0.5, width: int = 640, live: bool = True):
        self.conn = conn
        self.interval_s = interval_s
        self.width = width
        self.summary = W.HTML()
        self.problems = W.HTML()
        self.map_box = W.VBox([W.HTML("<i>waiting for the first pool snapshot from the plugin ...</i>")])
        self.page_map: PageMap | None = None
        self.findings = FindingsTable(lambda: findings_frame(conn.findings))
        self.findings.on_select.append(self._select)
        self.highlight: list[int] = []
        self.fig = self._figure()
        self.widget = W.VBox([self.summary, self.problems, W.HBox([self.map_box, self.fig]), self.findings.widget])
        self.refreshes = 0
        self._stop = threading.Event()
        self._thread = None
        self.refresh()
        if live:
            self._thread = threading.Thread(target=self._loop, name="kvwb-vllm-dashboard", daemon=True)
            self._thread.start()

    def _figure(self):
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
        fig = make_subplots(rows=len(TIMELINES), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                            subplot_titles=[t for _, t in TIMELINES])
        for i, (col, title) in enumerate(TIMELINES, start=1):
            fig.add_trace(go.Scatter(x=[], y=[], mode="lines", name=title, showlegend=False), row=i, col=1)
        fig.update_layout(height=420, width=520, margin=dict(l=40, r=10, t=30, b=30))
        return go.FigureWidget(fig)

    # ---- updates ------------------------------------------------------------------------
    def refresh(self) -> None:
        """Pull the connection's latest state into the widgets (what the thread does every interval)."""
        conn = self.conn
        self.summary.value = (f"<code>{html.escape(conn.summary_line())}</code><br>"
                              f"<code>{html.escape(conn.checks_line())}</code>")
        probs = conn.problems()
        self.problems.value = ("<div style='color:#b00020'>" + "<br>".join(html.escape(p) for p in probs) + "</div>"
                               if probs else "")
        pool = conn.pool
        if pool is not None:
            if self.page_map is None or self.page_map.num_pages != len(pool.ref):
                self.page_map = PageMap(len(pool.ref), width=self.width, details=self._details)
                self.map_box.children = [self.page_map]
            self.page_map.title = f"vLLM block pool, step {pool.step}: {len(pool.ref)} blocks"
            self.page_map.show(pool, highlight=self.highlight)
        df = conn.metrics_frame()
        if len(df):
            with self.fig.batch_update():
                for trace, (col, _) in zip(self.fig.data, TIMELINES):
                    if col in df:
                        trace.x = df["t"] - df["t"].iloc[0]
                        trace.y = df[col]
        self.findings.refresh()
        self.refreshes += 1

    def _details(self, block: int) -> dict:
        names = self.conn.sanitizer.names if self.conn.sanitizer else {}
        pool = self.conn.pool
        if pool is None or not 0 <= block < len(pool.owner):
            return {}
        o = int(pool.owner[block])
        return {"request": names.get(o)} if o >= 0 else {}

    def _select(self, row: dict) -> None:
        self.highlight = pages_named(row)
        if self.page_map is not None and self.conn.pool is not None:
            self.page_map.show(self.conn.pool, highlight=self.highlight)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception as e:               # a view never takes the notebook down
                self.problems.value = f"<div style='color:#b00020'>dashboard: {html.escape(repr(e))}</div>"

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

        def close_tree(w):
            for c in getattr(w, "children", ()):
                close_tree(c)
            w.close()
        close_tree(self.widget)

    def _repr_mimebundle_(self, **kw):
        return self.widget._repr_mimebundle_(**kw)
