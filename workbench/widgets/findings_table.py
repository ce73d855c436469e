"""FindingsTable: the session's findings, sortable and filterable; selecting one tells the others.

Built from ipywidgets over the findings DataFrame (workbench.findings.COLUMNS). A
selection calls every `on_select` callback with the finding as a dict plus `pages`
(every page it names), which the dashboard turns into a cursor move and highlights;
when a reload no longer holds the selected finding (the findings were reset), every
`on_clear` callback is called, and the dashboard drops its highlights.
"""
from __future__ import annotations

import html
import math
from typing import Callable

import ipywidgets as W

from ..findings import COLUMNS, SEVERITIES, SEVERITY_RANK

SORT_KEYS = ("step", "severity", "probe", "kind", "request_id", "layer", "page")
SEVERITY_COLOUR = {"info": "#555", "warn": "#b8860b", "error": "#c00000", "critical": "#7a0000"}


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def pages_named(row: dict) -> list[int]:
    """The page a finding names, and the pages its evidence names (page_read, page_meant, a pages list)."""
    out = []
    if not _missing(row.get("page")):
        out.append(int(row["page"]))
    ev = row.get("evidence") or {}
    if isinstance(ev, dict):
        for k in ("page_read", "page_meant"):
            if isinstance(ev.get(k), int):
                out.append(ev[k])
        if isinstance(ev.get("pages"), (list, tuple)):
            out.extend(int(p) for p in ev["pages"] if isinstance(p, int))
    return sorted(set(out))


class FindingsTable:
    def __init__(self, findings: Callable[[], object] | object, rows: int = 8):
        import pandas as pd
        self._source = findings if callable(findings) else (lambda df=findings: df)
        self.frame = pd.DataFrame(columns=COLUMNS)
        self.on_select: list[Callable[[dict], None]] = []
        self.on_clear: list[Callable[[], None]] = []
        self.selected: dict | None = None
        self.query = W.Text(placeholder="filter: text in message, kind, probe, hint", layout=W.Layout(width="260px"))
        self.severity = W.Dropdown(options=["all"] + list(SEVERITIES), value="all", description="at least",
                                   layout=W.Layout(width="170px"))
        self.probe = W.Dropdown(options=["all"], value="all", description="probe", layout=W.Layout(width="200px"))
        self.sort = W.Dropdown(options=SORT_KEYS, value="step", description="sort", layout=W.Layout(width="170px"))
        self.descending = W.ToggleButton(value=False, description="desc", layout=W.Layout(width="60px"))
        self.list = W.Select(options=[], rows=rows, layout=W.Layout(width="100%"))
        self.detail = W.HTML()
        self.picture = W.Box()          # an attention-read finding's per-head weights (want vs got), when it has one
        self.count = W.HTML()
        for w in (self.query, self.severity, self.probe, self.sort, self.descending):
            w.observe(lambda _c: self.redraw(), "value")
        self.list.observe(self._picked, "value")
        style = W.HTML("<style>.kvwb-findings select { font-family: monospace; font-size: 12px; }</style>")
        self.widget = W.VBox([style, W.HBox([self.query, self.severity, self.probe, self.sort, self.descending],
                                            layout=W.Layout(flex_flow="row wrap")),
                              self.count, self.list, self.detail, self.picture],
                             layout=W.Layout(flex="1 1 380px", min_width="380px"))
        self.widget.add_class("kvwb-findings")
        self._view = self.frame
        self.refresh()

    # ---- data ------------------------------------------------------------------
    def refresh(self) -> bool:
        """Reload the findings; redraws only when their number changed."""
        df = self._source()
        if df is None:
            return False
        if len(df) == len(self.frame):
            return False
        self.frame = df.reset_index(drop=True)
        probes = ["all"] + sorted(self.frame["probe"].dropna().unique().tolist())
        if list(self.probe.options) != probes:
            self.probe.options = probes
        self.redraw()
        if self.selected is not None and not self.holds(self.selected):
            self.selected = None                            # its finding is gone: so is what it marked
            self.detail.value = ""
            for fn in self.on_clear:
                fn()
        return True

    def holds(self, row: dict) -> bool:
        """Whether the findings hold this one (same probe, kind and time)."""
        f = self.frame
        return bool(((f["probe"] == row.get("probe")) & (f["kind"] == row.get("kind"))
                     & (f["time"] == row.get("time"))).any())

    def view(self):
        """The findings as shown: filtered, then sorted (missing values last)."""
        df = self.frame
        if self.severity.value != "all":
            df = df[df["severity"].map(SEVERITY_RANK) >= SEVERITY_RANK[self.severity.value]]
        if self.probe.value != "all":
            df = df[df["probe"] == self.probe.value]
        q = self.query.value.strip().lower()
        if q:
            text = (df["message"].astype(str) + " " + df["kind"].astype(str) + " " + df["probe"].astype(str)
                    + " " + df["hint"].astype(str)).str.lower()
            df = df[text.str.contains(q, regex=False)]
        key = self.sort.value
        if key == "severity":
            df = df.assign(_k=df["severity"].map(SEVERITY_RANK)).sort_values(
                "_k", ascending=not self.descending.value, kind="stable", na_position="last").drop(columns="_k")
        else:
            import pandas as pd
            as_key = (lambda s: s.astype(str)) if key in ("probe", "kind") else (
                lambda s: pd.to_numeric(s, errors="coerce"))
            df = df.sort_values(key, ascending=not self.descending.value, kind="stable", na_position="last",
                                key=as_key)
        return df

    def redraw(self) -> None:
        self._view = v = self.view()
        labels = []
        for i, (_, r) in enumerate(v.iterrows()):
            step = "" if _missing(r["step"]) else int(r["step"])
            labels.append((f"{str(step):>6} {r['severity']:<8} {r['probe']:<16} {r['kind']:<22} "
                           f"{str(r['message'])[:120]}", i))
        self.list.unobserve(self._picked, "value")
        self.list.options = labels
        self.list.value = None
        self.list.observe(self._picked, "value")
        self.count.value = f"<b>{len(v)}</b> of {len(self.frame)} findings"

    def rows(self) -> list[dict]:
        """The shown findings as dicts, in order."""
        return self._view.to_dict("records")

    @staticmethod
    def _picture_of(row: dict, ev: dict):
        """The finding's attention picture as a widget (probes/attention_picture.py draws it)."""
        import plotly.graph_objects as go
        from probes.attention_picture import weights_figure
        fig = weights_figure(ev["picture"], heads=ev.get("heads"), max_heads=3,
                             title=f"request {row.get('request_id')}, layer "
                                   f"{ev.get('layer', row.get('layer'))}: attention weights")
        fig.update_layout(margin=dict(l=40, r=10, t=60, b=40))
        return go.FigureWidget(fig)

    # ---- selection ---------------------------------------------------------------
    def select(self, index: int) -> dict:
        """Select the index-th shown finding (what a click in the list does)."""
        self.list.value = index
        return self.selected

    def _picked(self, change) -> None:
        i = change["new"]
        if i is None or i >= len(self._view):
            return
        row = self._view.iloc[i].to_dict()
        row["pages"] = pages_named(row)
        self.selected = row
        sev = row["severity"]
        ev = row.get("evidence") if isinstance(row.get("evidence"), dict) else {}
        shown = {k: v for k, v in ev.items() if k != "picture"} if ev else row.get("evidence")
        self.detail.value = (
            f"<div style='font-size:12px'><b style='color:{SEVERITY_COLOUR.get(sev, '#000')}'>{html.escape(sev)}"
            f"</b> {html.escape(str(row['kind']))}: {html.escape(str(row['message']))}<br>"
            f"<b>fix:</b> {html.escape(str(row['hint']))}<br>"
            f"<span style='color:#666'>evidence: {html.escape(str(shown))[:600]}</span></div>")
        self.picture.children = [self._picture_of(row, ev)] if ev.get("picture") else []
        for fn in self.on_select:
            fn(row)
