"""Timelines: one plotly FigureWidget of stacked panels over steps, with one shared cursor.

Panels: pool usage and cached pages; running / waiting requests and preemptions; step
time and tokens; achieved bandwidth against the peak; lock wait; FP16 headroom (layer x
step heatmap); batch composition (the cu_seqlens segments of each step, coloured by
request with the page map's hues). The x axes are matched, so zoom moves every panel,
and one vertical line (the cursor) crosses them all.

Data: StepFinished, BatchPacked, LockWaited and KVWritten from the EventLog, read
incrementally (LogTail); the probes' frames where attached (fp16_overflow's headroom,
bandwidth's peak). Lines are bucketed to `max_points` (max per bucket: spikes survive).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ..events import BatchPacked, KVWritten, LockWaited, StepFinished
from .log_tail import LogTail
from .page_map import PALETTE, hue_of

FP16_MAX = 65504.0
PANELS = ("pool pages", "requests", "step time / tokens", "bandwidth (GB/s)", "lock wait (ms)",
          "FP16 headroom: log10(absmax / 65504) per layer", "batch composition (cu_seqlens segments)")
STEP_FIELDS = ["step", "duration_ns", "num_tokens", "pages_used", "pages_cached", "num_running", "num_waiting",
               "num_preemptions", "bytes_weights", "bytes_kv_read", "bytes_kv_written"]


def bucket_max(x: np.ndarray, y: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """At most n points: the first x and the max y of each bucket (a spike is never averaged away)."""
    if len(x) <= n:
        return x, y
    edges = np.linspace(0, len(x), n + 1).astype(int)[:-1]
    return x[edges], np.fmax.reduceat(y, edges)


def _rgb(request_id: int) -> str:
    r, g, b = PALETTE[2 | (int(hue_of(np.array([request_id]))[0]) << 2)]
    return f"rgb({r},{g},{b})"


class Timelines:
    def __init__(self, log, probes: Callable[[], dict] | dict | None = None, max_points: int = 2000,
                 segment_window: int = 200, height: int = 1050):
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
        self.log = log
        self._probes = probes if callable(probes) else (lambda p=probes or {}: p)
        self.max_points = max_points
        self.segment_window = segment_window           # steps of batch composition drawn around the cursor
        self._steps = LogTail(log, StepFinished, STEP_FIELDS)
        self._packed = LogTail(log, BatchPacked, ["step", "request_ids", "query_lens"])
        self._waits = LogTail(log, LockWaited, ["step", "lock", "wait_ns"])
        self._kv = LogTail(log, KVWritten, ["step", "layer", "k_absmax", "v_absmax"])
        self.cols: dict[str, list] = {f: [] for f in STEP_FIELDS}
        self.segments: dict[int, tuple[list, list]] = {}      # step -> (request ids, query lens)
        self.lock_wait: dict[str, dict[int, float]] = {}      # lock -> step -> ms waited
        self.kv_absmax: dict[tuple[int, int], float] = {}     # (layer, step) -> absmax (from KVWritten)
        self.cursor: int | None = None
        self.layer: int | None = None                        # highlighted heatmap row
        self.on_cursor: list[Callable[[int], None]] = []     # told when a click on a panel moves the cursor
        self.refreshes = 0

        fig = make_subplots(rows=7, cols=1, shared_xaxes=True, vertical_spacing=0.035, subplot_titles=PANELS,
                            row_heights=[1, 1, 1, 1, 1, 1.3, 1.3],
                            specs=[[{}], [{}], [{"secondary_y": True}], [{}], [{}], [{}], [{}]])
        fig = go.FigureWidget(fig)
        line = dict(mode="lines", line=dict(width=1.5))
        fig.add_scatter(name="pages used", **line, row=1, col=1)
        fig.add_scatter(name="pages cached", **line, row=1, col=1)
        fig.add_scatter(name="running", **line, row=2, col=1)
        fig.add_scatter(name="waiting", **line, row=2, col=1)
        fig.add_bar(name="preempted", row=2, col=1)
        fig.add_scatter(name="step ms", **line, row=3, col=1)
        fig.add_scatter(name="tokens", **line, row=3, col=1, secondary_y=True)
        fig.add_scatter(name="achieved GB/s", **line, row=4, col=1)
        fig.add_scatter(name="peak GB/s", mode="lines", line=dict(dash="dash", color="black", width=1), row=4, col=1)
        fig.add_heatmap(name="fp16 headroom", colorscale="Turbo", zmin=-6, zmax=0, showscale=True,
                        colorbar=dict(thickness=10, title=dict(text="log10")), row=6, col=1)
        fig.add_bar(name="segments", row=7, col=1, marker=dict(line=dict(width=0.5, color="white")),
                    hovertemplate="step %{x}: request %{customdata[0]}, %{y} tokens from %{base}<extra></extra>")
        fig.data[9].showlegend = fig.data[10].showlegend = False
        self._legends = {}
        for r in range(1, 6):                          # a legend beside each line panel
            key = "legend" if r == 1 else f"legend{r}"
            lo, hi = fig.get_subplot(r, 1).yaxis.domain
            self._legends[r] = key
            fig.update_layout({key: dict(x=1.01, xanchor="left", y=hi, yanchor="top", font=dict(size=10),
                                         bgcolor="rgba(255,255,255,0)")})
        rows_of = [1, 1, 2, 2, 2, 3, 3, 4, 4]
        for tr, r in zip(fig.data, rows_of):
            tr.legend = self._legends[r]
        fig.update_xaxes(matches="x")
        fig.update_xaxes(title_text="step", row=7, col=1)
        fig.update_yaxes(title_text="layer", row=6, col=1)
        fig.update_layout(height=height, margin=dict(l=50, r=130, t=30, b=30), bargap=0.1,
                          barmode="overlay", hovermode="x", uirevision="keep")
        sp = fig.get_subplot(6, 1)                    # axis names shift after the secondary y of row 3
        self._heat_axes = (sp.xaxis.plotly_name.replace("axis", ""), sp.yaxis.plotly_name.replace("axis", ""))
        lo, hi = sp.yaxis.domain
        fig.data[9].colorbar.update(y=(lo + hi) / 2, len=hi - lo)
        self.fig = fig
        self._lock_traces: dict[str, int] = {}
        for tr in fig.data:
            tr.on_click(self._clicked)

    # ---- data ------------------------------------------------------------------
    def _probe(self, name: str):
        try:
            return self._probes().get(name)
        except Exception:
            return None

    def ingest(self) -> bool:
        """Pull new rows from the log; True when anything arrived."""
        new = self._steps.read()
        for f in STEP_FIELDS:
            self.cols[f].extend(new[f])
        packed = self._packed.read()
        for s, rids, q in zip(packed["step"], packed["request_ids"], packed["query_lens"]):
            self.segments[int(s)] = (list(rids or ()), list(q or ()))
        waits = self._waits.read()
        for s, lock, ns in zip(waits["step"], waits["lock"], waits["wait_ns"]):
            d = self.lock_wait.setdefault(str(lock), {})
            d[int(s)] = d.get(int(s), 0.0) + ns / 1e6
        kv = self._kv.read()
        for s, l, k, v in zip(kv["step"], kv["layer"], kv["k_absmax"], kv["v_absmax"]):
            key = (int(l), int(s))
            self.kv_absmax[key] = max(self.kv_absmax.get(key, 0.0), float(np.fmax(k, v)))
        return bool(new["step"] or packed["step"] or waits["step"] or kv["step"])

    def series(self) -> dict[str, np.ndarray]:
        c = {f: np.asarray(v, dtype=np.float64) for f, v in self.cols.items()}
        out = dict(c)
        pre = c["num_preemptions"]
        out["preempted"] = np.diff(pre, prepend=pre[:1]) if len(pre) else pre
        seconds = c["duration_ns"] / 1e9
        nbytes = c["bytes_weights"] + c["bytes_kv_read"] + c["bytes_kv_written"]
        with np.errstate(divide="ignore", invalid="ignore"):
            out["gbs"] = np.where(seconds > 0, nbytes / seconds / 1e9, np.nan)
        out["step_ms"] = c["duration_ns"] / 1e6
        return out

    def peak_gbs(self) -> float | None:
        p = self._probe("bandwidth")
        peak = getattr(p, "peak_gbs", None)
        return float(peak) if peak else None

    def headroom(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(steps, layers, log10 headroom [layers x steps]) from the fp16_overflow probe, else KVWritten."""
        p = self._probe("fp16_overflow")
        df = None
        if p is not None:
            try:
                df = p.frame()
            except Exception:
                df = None
        if df is not None and len(df) and {"step", "layer"} <= set(df.columns):
            if "headroom" in df:
                val = df["headroom"].astype(float)
            else:
                cols = [c for c in ("k_absmax", "v_absmax", "hidden_absmax") if c in df]
                val = df[cols].astype(float).max(axis=1) / FP16_MAX if cols else None
            if val is not None:
                grid = df.assign(v=val).pivot_table(index="layer", columns="step", values="v", aggfunc="max")
                return self._log_grid(grid.columns.to_numpy(), grid.index.to_numpy(), grid.to_numpy())
        if not self.kv_absmax:
            return np.array([]), np.array([]), np.zeros((0, 0))
        layers = np.array(sorted({l for l, _ in self.kv_absmax}))
        steps = np.array(sorted({s for _, s in self.kv_absmax}))
        li = {l: i for i, l in enumerate(layers)}
        si = {s: i for i, s in enumerate(steps)}
        z = np.full((len(layers), len(steps)), np.nan)
        for (l, s), v in self.kv_absmax.items():
            z[li[l], si[s]] = v / FP16_MAX
        return self._log_grid(steps, layers, z)

    def _log_grid(self, steps, layers, z):
        if len(steps) > self.max_points:                 # keep the worst (largest) value per bucket
            edges = np.linspace(0, len(steps), self.max_points + 1).astype(int)[:-1]
            steps, z = steps[edges], np.fmax.reduceat(np.nan_to_num(z, nan=0.0), edges, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return steps, layers, np.log10(np.where(z > 0, z, np.nan))

    def segment_bars(self) -> dict[str, list]:
        """Bars for the batch composition panel, within segment_window steps of the cursor (or the end)."""
        if not self.segments:
            return {"x": [], "y": [], "base": [], "color": [], "rid": []}
        steps = sorted(self.segments)
        centre = self.cursor if self.cursor is not None else steps[-1]
        lo, hi = centre - self.segment_window // 2, centre + self.segment_window // 2
        if centre >= steps[-1]:
            lo, hi = steps[-1] - self.segment_window, steps[-1]
        x, y, base, color, rid = [], [], [], [], []
        for s in steps:
            if not lo <= s <= hi:
                continue
            rids, q = self.segments[s]
            start = 0
            for r, n in zip(rids, q):
                x.append(s), y.append(n), base.append(start), color.append(_rgb(r)), rid.append([r])
                start += n
        return {"x": x, "y": y, "base": base, "color": color, "rid": rid}

    # ---- drawing ---------------------------------------------------------------
    def refresh(self, force: bool = False) -> bool:
        """Ingest and redraw; returns whether anything was drawn."""
        if not self.ingest() and not force:
            return False
        s = self.series()
        fig, n = self.fig, self.max_points
        x = s["step"]

        def put(i, key, y=None):
            xs, ys = bucket_max(x, s[key] if y is None else y, n)
            fig.data[i].x, fig.data[i].y = xs, ys
        with fig.batch_update():
            put(0, "pages_used")
            put(1, "pages_cached")
            put(2, "num_running")
            put(3, "num_waiting")
            put(4, "preempted")
            put(5, "step_ms")
            put(6, "num_tokens")
            put(7, "gbs")
            peak = self.peak_gbs()
            fig.data[8].x, fig.data[8].y = ((x[0], x[-1]), (peak, peak)) if peak and len(x) else ((), ())
            hs, hl, hz = self.headroom()
            fig.data[9].x, fig.data[9].y, fig.data[9].z = hs, hl, hz
            self._draw_locks()
            self._draw_segments()
            self._draw_cursor()
        self.refreshes += 1
        return True

    def _draw_locks(self) -> None:
        fig = self.fig
        for lock in sorted(self.lock_wait):
            if lock not in self._lock_traces:
                fig.add_scatter(name=f"wait {lock}", mode="lines+markers", marker=dict(size=3),
                                legend=self._legends[5], row=5, col=1)
                self._lock_traces[lock] = len(fig.data) - 1
                fig.data[-1].on_click(self._clicked)
            d = self.lock_wait[lock]
            steps = np.array(sorted(d), dtype=np.float64)
            xs, ys = bucket_max(steps, np.array([d[int(k)] for k in steps]), self.max_points)
            tr = fig.data[self._lock_traces[lock]]
            tr.x, tr.y = xs, ys

    def _draw_segments(self) -> None:
        b = self.segment_bars()
        tr = self.fig.data[10]
        tr.x, tr.y, tr.base, tr.customdata = b["x"], b["y"], b["base"], b["rid"]
        tr.marker.color = b["color"]

    def _draw_cursor(self) -> None:
        shapes = []
        if self.cursor is not None:
            shapes.append(dict(type="line", xref="x", yref="paper", x0=self.cursor, x1=self.cursor, y0=0, y1=1,
                               line=dict(color="#e00000", width=1.5), name="cursor"))
        if self.layer is not None:
            hx, hy = self._heat_axes
            shapes.append(dict(type="rect", xref=f"{hx} domain", yref=hy, x0=0, x1=1, y0=self.layer - 0.5,
                               y1=self.layer + 0.5, line=dict(color="#e00000", width=2), name="layer"))
        self.fig.layout.shapes = shapes

    def set_cursor(self, step: int | None, layer: int | None = None, keep_layer: bool = True) -> None:
        """Move the shared cursor (and optionally mark a layer on the heatmap)."""
        self.cursor = None if step is None else int(step)
        if not keep_layer or layer is not None:
            self.layer = layer
        with self.fig.batch_update():
            self._draw_segments()
            self._draw_cursor()

    def cursor_x(self) -> float | None:
        """Where the figure's cursor line stands (what the browser draws)."""
        for sh in self.fig.layout.shapes:
            if sh.name == "cursor":
                return sh.x0
        return None

    def _clicked(self, trace, points, state) -> None:
        xs = getattr(points, "xs", None)
        if not xs:
            return
        step = int(round(float(xs[0])))
        if not math.isfinite(step):
            return
        self.set_cursor(step)
        for fn in self.on_cursor:
            fn(step)
