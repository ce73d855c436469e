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
# Where a non-finite K/V or hidden state (inf/NaN: past fp16's range) is drawn on the headroom
# heatmap: log10 headroom 1, ten times the fp16 max, above the colour scale's top (0). Never NaN:
# a NaN in the figure is no JSON, and the kernel warns on every message that carries one.
NONFINITE_LOG10 = 1.0
PANELS = ("pool pages", "requests", "step time / tokens", "bandwidth (GB/s)", "lock wait (ms)",
          "FP16 headroom: log10(absmax / 65504) per layer", "batch composition (cu_seqlens segments)")
STEP_FIELDS = ["step", "duration_ns", "num_tokens", "pages_used", "pages_cached", "num_running", "num_waiting",
               "num_preemptions", "bytes_weights", "bytes_kv_read", "bytes_kv_written"]


def _put(cols: dict, step: int, layer: int, value: float) -> None:
    c = cols.get(step)
    if c is None or layer >= len(c):
        grown = np.full(layer + 1, np.nan)
        if c is not None:
            grown[: len(c)] = c
        c = cols[step] = grown
    if not math.isfinite(value):                 # inf/NaN K/V: the worst headroom there is, not a gap
        value = math.inf
    c[layer] = np.fmax(c[layer], value)


def bucket_max(x: np.ndarray, y: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """At most n points: the first x and the max y of each bucket (a spike is never averaged away)."""
    if len(x) <= n:
        return x, y
    edges = np.linspace(0, len(x), n + 1).astype(int)[:-1]
    return x[edges], np.fmax.reduceat(y, edges)


_RGB: dict = {}


def _rgb(request_id) -> str:
    """The page map's colour for an owned page of this request."""
    c = _RGB.get(request_id)
    if c is None:
        hue = int(hue_of(np.array([request_id if isinstance(request_id, int) else -1]))[0])
        r, g, b = PALETTE[2 | (hue << 2)]
        c = _RGB[request_id] = f"rgb({r},{g},{b})"
    return c


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
        self.kv_headroom: dict[int, np.ndarray] = {}          # step -> absmax / 65504 per layer (KVWritten)
        self.probe_headroom: dict[int, np.ndarray] = {}       # step -> headroom per layer (fp16_overflow)
        self._probe_rows = 0
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
        hx, hy = sp.xaxis.plotly_name.replace("axis", ""), sp.yaxis.plotly_name.replace("axis", "")
        fig.layout.shapes = [
            dict(type="line", xref="x", yref="paper", x0=0, x1=0, y0=0, y1=1, visible=False, name="cursor",
                 line=dict(color="#e00000", width=1.5)),
            dict(type="rect", xref=f"{hx} domain", yref=hy, x0=0, x1=1, y0=0, y1=1, visible=False, name="layer",
                 line=dict(color="#e00000", width=2))]
        lo, hi = sp.yaxis.domain
        fig.data[9].colorbar.update(y=(lo + hi) / 2, len=hi - lo)
        self.fig = fig
        self._lock_traces: dict[str, int] = {}
        self._segments_drawn = None
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
            _put(self.kv_headroom, int(s), int(l), float(np.fmax(k, v)) / FP16_MAX)
        fp16 = self._ingest_fp16()
        return bool(new["step"] or packed["step"] or waits["step"] or kv["step"] or fp16)

    def _ingest_fp16(self) -> bool:
        """New rows of the fp16_overflow probe (its `rows`, else its frame()): headroom per layer and step."""
        p = self._probe("fp16_overflow")
        if p is None:
            return False
        rows = getattr(p, "rows", None)
        if not isinstance(rows, list):
            try:
                rows = p.frame().to_dict("records")
            except Exception:
                return False
        if len(rows) < self._probe_rows:                     # the probe was reset
            self.probe_headroom.clear()
            self._probe_rows = 0
        new, self._probe_rows = rows[self._probe_rows:], len(rows)
        for r in new:
            if not isinstance(r, dict) or r.get("step") is None or r.get("layer") is None:
                continue
            v = r.get("headroom")
            if v is None:
                vals = [r[k] for k in ("k_absmax", "v_absmax", "hidden_absmax") if r.get(k) is not None]
                v = max(vals) / FP16_MAX if vals else None
            if v is not None:
                _put(self.probe_headroom, int(r["step"]), int(r["layer"]), float(v))
        return bool(new)

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
        """(steps, layers, log10 headroom [layers x steps]): the fp16_overflow probe's when it is
        attached (K, V and hidden states), else KVWritten's (K and V absmax before the cast)."""
        cols = self.probe_headroom or self.kv_headroom
        if not cols:
            return np.array([]), np.array([]), np.zeros((0, 0))
        steps = np.array(sorted(cols))
        L = max(len(c) for c in cols.values())
        z = np.full((L, len(steps)), np.nan)
        for i, s in enumerate(steps):
            c = cols[s]
            z[: len(c), i] = c
        if len(steps) > self.max_points:                 # keep the worst (largest) value per bucket
            edges = np.linspace(0, len(steps), self.max_points + 1).astype(int)[:-1]
            steps, z = steps[edges], np.fmax.reduceat(np.nan_to_num(z, nan=0.0, posinf=np.inf), edges, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = np.log10(np.where(z > 0, z, np.nan))
        h[np.isposinf(h)] = NONFINITE_LOG10
        return steps, np.arange(L), h

    def segment_window_at(self) -> tuple[int, int]:
        """The steps of batch composition drawn: segment_window of them around the cursor (or the end)."""
        last = max(self.segments) if self.segments else 0
        centre = self.cursor if self.cursor is not None else last
        if centre >= last:
            return last - self.segment_window, last
        return centre - self.segment_window // 2, centre + self.segment_window // 2

    def segment_bars(self) -> dict[str, list]:
        """Bars for the batch composition panel: per step, one bar per packed sequence, stacked in
        cu_seqlens order (base = its offset), coloured as its pages are on the page map."""
        if not self.segments:
            return {"x": [], "y": [], "base": [], "color": [], "rid": []}
        steps = sorted(self.segments)
        lo, hi = self.segment_window_at()
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
        self.draw()
        return True

    def draw(self) -> None:
        """Redraw every panel from what was ingested (and the cursor)."""
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
        key = (self.segment_window_at(), len(self.segments))
        if key == self._segments_drawn:
            return
        self._segments_drawn = key
        b = self.segment_bars()
        tr = self.fig.data[10]
        tr.x, tr.y, tr.base, tr.customdata = b["x"], b["y"], b["base"], b["rid"]
        tr.marker.color = b["color"]

    def _draw_cursor(self) -> None:
        # Two fixed shapes, moved in place: a relayout of a few keys, not a new shapes list.
        cur, lay = self.fig.layout.shapes
        c, l = self.cursor, self.layer
        if (cur.visible, cur.x0, lay.visible, lay.y0) != (c is not None, c, l is not None,
                                                             None if l is None else l - 0.5):
            cur.update(visible=c is not None, x0=c, x1=c)
            lay.update(visible=l is not None, y0=None if l is None else l - 0.5, y1=None if l is None else l + 0.5)

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
        cur = self.fig.layout.shapes[0]
        return cur.x0 if cur.visible else None

    def layer_marked(self) -> float | None:
        """The heatmap row the layer box surrounds (None when hidden)."""
        lay = self.fig.layout.shapes[1]
        return (lay.y0 + lay.y1) / 2 if lay.visible else None

    def _clicked(self, trace, points, state) -> None:
        xs = getattr(points, "xs", None)
        if not xs:
            return
        x = float(xs[0])
        if not math.isfinite(x):
            return
        step = int(round(x))
        self.set_cursor(step)
        for fn in self.on_cursor:
            fn(step)
