"""Dashboard: page map, timelines and findings on one step cursor, live or time-travelling.

Live: it listens to StepFinished and refreshes at most every `min_interval_s` (10 Hz),
and never spends more than `max_share` (5%, the probes' own budget) of the wall time
between refreshes on itself (a 20 ms refresh waits 400 ms for the next), so the engine
slows no more than that.
The refresh that the throttle skipped at the end of a run happens when the notebook
cell finishes (IPython's post_run_cell) or on refresh(force=True).

Time travel: the step slider (with a Play button) moves one cursor; the page map shows
TimeTravel(log).state_at(step), the timelines draw the cursor line, and a finding picked
in the table moves the cursor to its step and highlights its pages and layer (until the
findings are reset: then the highlights go with it). While
following a live engine, the head step shows the live pool (live_state: what
PoolState.from_engine returns, vectorised).
"""
from __future__ import annotations

import html
import time
from typing import Any, Callable

import ipywidgets as W
import numpy as np

from ..events import StepFinished
from ..trace.timetravel import PoolState, TimeTravel
from .findings_table import FindingsTable
from .page_map import PageMap, live_page_details
from .timelines import Timelines


MAX_SHARE = 0.03          # of the engine's wall time, at most, spent refreshing: no more than the probes cost (~3%)


def live_state(engine) -> PoolState:
    """PoolState.from_engine(engine), vectorised: the same arrays, ~3x faster on a 131,072-page
    pool (where from_engine's per-page Python loop costs 40-80 ms, too slow for 10 updates/s)."""
    pool = engine.pool
    n = pool.num_pages
    st = PoolState.empty(n, engine.step_count)
    st.ref[:] = pool.ref
    if pool.num_cached_free:                      # cached = free and still hashed; few pages, checked one by one
        hashed = np.fromiter((h is not None for h in pool.page_hash), bool, n)
        cand = np.nonzero(hashed & (st.ref == 0))[0]
        st.cached[cand] = [pool.is_free(int(p)) for p in cand]
    seqs = list(engine.scheduler.running) + list(engine.scheduler.waiting)
    held = [s for s in seqs if s.pages]
    if held:
        for s in reversed(held):                  # the first holder (running before waiting) wins
            st.owner[s.pages] = s.request_id
        count = np.bincount(np.concatenate([np.asarray(s.pages, np.int64) for s in held]), minlength=n)
        multi = set(np.nonzero(count > 1)[0].tolist())
        if multi:
            holders: dict[int, list] = {}
            for s in held:
                for p in multi.intersection(s.pages):
                    holders.setdefault(p, []).append(s.request_id)
            st.shared_owners.update({p: tuple(r) for p, r in holders.items()})
    return st


class Throttle:
    """Lets a refresh through when min_interval_s has passed since the last one began and
    the last one's cost is at most max_share of the interval."""

    def __init__(self, min_interval_s: float = 0.1, max_share: float = MAX_SHARE, clock: Callable[[], float] = time.perf_counter):
        self.min_interval_s, self.max_share, self.clock = min_interval_s, max_share, clock
        self.next_at = float("-inf")

    def due(self) -> bool:
        return self.clock() >= self.next_at

    def done(self, started: float) -> None:
        cost = self.clock() - started
        self.next_at = started + max(self.min_interval_s, cost / self.max_share if self.max_share else 0.0)


class Dashboard:
    def __init__(self, log, num_pages: int, engine=None, probes: dict | Callable[[], dict] | None = None,
                 findings: Callable[[], Any] | Any = None, live: bool = True, title: str = "PagedKV dashboard",
                 min_interval_s: float = 0.1, max_share: float = MAX_SHARE, clock: Callable[[], float] = time.perf_counter,
                 map_width: int = 640, map_height: int = 360):
        import pandas as pd
        from ..findings import COLUMNS
        self.log, self.engine, self.num_pages, self.title = log, engine, num_pages, title
        self.page_map = PageMap(num_pages, width=map_width, max_height=map_height, details=self._details)
        self.timelines = Timelines(log, probes)
        self.table = FindingsTable(findings if findings is not None else pd.DataFrame(columns=COLUMNS))
        # Tensor parallel: a per-rank strip (step time, bandwidth, digest agreement) beside the page map.
        world = getattr(getattr(engine, "parallel", None), "world", 1)
        self.ranks = None
        if world > 1:
            from .rank_strip import RankStrip
            self.ranks = RankStrip(log, world)
        self.throttle = Throttle(min_interval_s, max_share, clock)
        self.refreshes = 0
        self.skipped = 0
        self.busy_s = 0.0                            # time spent refreshing (on the engine's thread when live)
        self._tt: TimeTravel | None = None
        self._tt_seq = -1
        self._highlight: list[int] = []
        self._quiet = False                      # set while the dashboard itself moves the slider
        # continuous_update=False: the browser sends a step when the drag ends, never while it
        # re-lays the slider out for a new max (those echoes would land late and pull the cursor back).
        self.slider = W.IntSlider(0, min=0, max=0, description="step", continuous_update=False,
                                  layout=W.Layout(width="520px"))
        self.slider.add_class("kvwb-step-slider")
        self.play = W.Play(0, min=0, max=0, interval=150, description="play")
        # A kernel-side link, not jslink: while a cell runs the engine, the browser's jslink echoes
        # queue up and land after it, dragging the slider back to an old step.
        W.link((self.play, "value"), (self.slider, "value"))
        self.follow = W.ToggleButton(value=False, description="follow live", icon="circle",
                                     disabled=engine is None)
        self.status = W.HTML()
        self.slider.observe(self._on_slider, "value")
        self.follow.observe(self._on_follow, "value")
        self.table.on_select.append(self._on_finding)
        self.table.on_clear.append(self._on_finding_gone)
        self.timelines.on_cursor.append(self._on_timeline_click)
        # which kernels the engine runs (engine.kernels, decided once at start-up), beside the title
        ks = getattr(engine, "kernels", None)
        kline = f" <span style='font-size:11px;color:#555'>kernels: {html.escape(ks.short())}</span>" if ks else ""
        self.widget = W.VBox([W.HTML(f"<b>{title}</b>{kline}"), self.status,
                              W.HBox([self.play, self.slider, self.follow]),
                              W.HBox([self.page_map] + ([self.ranks.widget] if self.ranks is not None else [])
                                     + [self.table.widget],
                                     layout=W.Layout(align_items="flex-start", flex_flow="row wrap")),
                              self.timelines.fig])
        self.widget.add_class("kvwb-dashboard")
        self._subscribed = False
        self._ip_hook = None
        if live and engine is not None and hasattr(engine, "bus"):
            self.start()
        self.refresh(force=True)
        if not self.follow.value:                   # a finished run: open at its last step
            self._quiet = True
            self.slider.value = self.slider.max
            self._quiet = False
            self.show_step(self.slider.value)

    # ---- sources -----------------------------------------------------------------
    @classmethod
    def from_workbench(cls, wb, live: bool = True, **kw) -> "Dashboard":
        if wb.log is None:
            raise ValueError("the dashboard reads the workbench's EventLog: create it with Workbench(engine, log=True)")
        return cls(wb.log, wb.engine.pool.num_pages, engine=wb.engine, probes=lambda: wb.probes,
                   findings=lambda: wb.findings, live=live, **kw)

    @classmethod
    def from_replay(cls, result, workbench=None, **kw) -> "Dashboard":
        """A finished replay (ReplayResult): a time-travel view over its log."""
        if result.log is None:
            raise ValueError("the replay kept no EventLog: run replay(..., log=True)")
        engine = result.engine
        probes = (lambda: workbench.probes) if workbench is not None else None
        findings = (lambda: workbench.findings) if workbench is not None else result.findings
        kw.setdefault("title", f"replay ({result.mode})")
        return cls(result.log, engine.pool.num_pages, engine=engine, probes=probes, findings=findings,
                   live=False, **kw)

    # ---- live ------------------------------------------------------------------------
    def start(self) -> None:
        """Follow the engine: refresh on StepFinished (throttled) and after each notebook cell."""
        if not self._subscribed:
            self.engine.bus.subscribe(StepFinished, self._on_step)
            self._subscribed = True
            try:
                from IPython import get_ipython
                ip = get_ipython()
            except ImportError:
                ip = None
            if ip is not None and self._ip_hook is None:
                self._ip_hook = lambda *_a: self._safe(self.refresh, True)
                ip.events.register("post_run_cell", self._ip_hook)
        self.follow.value = True

    def stop(self) -> None:
        """Stop following: the view stays, as a time-travel view over what was logged."""
        was = self._subscribed
        if was:
            self.engine.bus.unsubscribe(self._on_step)
            self._subscribed = False
        if self._ip_hook is not None:
            try:
                from IPython import get_ipython
                get_ipython().events.unregister("post_run_cell", self._ip_hook)
            except Exception:
                pass
            self._ip_hook = None
        self.follow.value = False
        if was:
            self.refresh(force=True)

    def close(self) -> None:
        """Stop following and close every widget of the view (their comms with the browser)."""
        self.stop()

        def close_tree(w):
            for c in getattr(w, "children", ()):
                close_tree(c)
            w.close()
        close_tree(self.widget)
        self.play.close()

    def _repr_mimebundle_(self, **kw):
        return self.widget._repr_mimebundle_(**kw)

    def _safe(self, fn, *a) -> None:
        try:
            fn(*a)
        except Exception as e:                   # a view never raises into the engine or the kernel
            self.status.value = f"<span style='color:#c00'>dashboard refresh failed: {type(e).__name__}: {e}</span>"

    def _on_step(self, _e: StepFinished) -> None:
        if not self.throttle.due():
            self.skipped += 1
            return
        self._safe(self.refresh)

    # ---- refresh -----------------------------------------------------------------------
    def head(self) -> int:
        """The newest step there is: the engine's, else the log's."""
        if self.engine is not None and self._subscribed:
            return int(self.engine.step_count)
        steps = self.timelines.cols["step"]
        last = int(steps[-1]) if steps else 0
        tt = self._time_travel()
        return max(last, tt.last_step if tt is not None else 0)

    def refresh(self, force: bool = False) -> None:
        t0 = self.throttle.clock()
        new = self.timelines.ingest()
        head = self.head()
        follow = self.follow.value
        if follow:
            self.timelines.cursor = head
        if new or force:
            self.timelines.draw()                    # the cursor line moves with the redraw
        elif follow:
            self.timelines.set_cursor(head)
        self.table.refresh()
        if self.ranks is not None:
            self.ranks.refresh()
        self._quiet = True
        try:
            with self.slider.hold_sync():
                self.slider.max = head
                self.play.max = head
                if follow:
                    self.slider.value = head
        finally:
            self._quiet = False
        if follow:
            self.page_map.show(self.state_at(head), highlight=self._highlight)
        self._status()
        self.refreshes += 1
        self.busy_s += self.throttle.clock() - t0
        self.throttle.done(t0)

    def _status(self) -> None:
        mode = "live" if self.follow.value else "time travel"
        parts = [f"<b>{mode}</b>", f"step {self.slider.value} of {self.slider.max}"]
        st = self.page_map.state
        if st is not None:
            c = st.counts()
            parts.append(f"pages: {c['owned']} owned, {c['shared']} shared, {c['cached']} cached, "
                         f"{c['free']} free of {self.num_pages}")
        if self.engine is not None and hasattr(self.engine, "scheduler"):
            parts.append(f"running {len(self.engine.scheduler.running)}, waiting {len(self.engine.scheduler.waiting)}")
        parts.append(f"{len(self.table.frame)} findings")
        parts.append(f"refreshes {self.refreshes} (throttled {self.skipped})")
        self.status.value = "<span style='font-size:12px'>" + " · ".join(parts) + "</span>"

    # ---- the cursor --------------------------------------------------------------------
    def _time_travel(self) -> TimeTravel | None:
        if self.log is None:
            return None
        if self._tt is None or self._tt_seq != self.log.seq:
            self._tt_seq = self.log.seq
            self._tt = TimeTravel(self.log, self.num_pages)
        return self._tt

    def state_at(self, step: int) -> PoolState:
        eng = self.engine
        if eng is not None and step >= eng.step_count and hasattr(eng, "scheduler"):
            return live_state(eng)                         # the head: the live pool itself
        tt = self._time_travel()
        return tt.state_at(step) if tt is not None else PoolState.empty(self.num_pages, step)

    def show_step(self, step: int) -> None:
        """Draw every view at `step`."""
        self.page_map.show(self.state_at(step), highlight=self._highlight)
        self.timelines.set_cursor(step)

    def _on_slider(self, change) -> None:
        if self._quiet:
            return
        step = change["new"]
        if self.follow.value and step < self.head():
            self._quiet = True                              # the user scrubbed back: stop following
            self.follow.value = False
            self._quiet = False
        self._safe(self.show_step, step)
        self._status()

    def _on_follow(self, change) -> None:
        if self._quiet:
            return
        if change["new"]:                                   # back to the head (and listening again)
            if not self._subscribed and self.engine is not None and hasattr(self.engine, "bus"):
                self.start()
            self._safe(self.refresh, True)
        self._status()

    def goto(self, step: int) -> None:
        """Move the cursor (as the slider does)."""
        self.slider.value = max(self.slider.min, min(int(step), self.slider.max))

    def _on_timeline_click(self, step: int) -> None:
        self.follow.value = False
        self.goto(step)

    def _on_finding(self, row: dict) -> None:
        self._highlight = list(row.get("pages") or [])
        layer = row.get("layer")
        layer = None if layer is None or layer != layer else int(layer)
        self.timelines.layer = layer
        self.follow.value = False
        step = row.get("step")
        if step is not None and step == step:
            step = max(self.slider.min, min(int(step), self.slider.max))
            if step != self.slider.value:
                self.slider.value = step                    # -> show_step, with the highlight
                return
        self._safe(self.show_step, self.slider.value)

    def _on_finding_gone(self) -> None:
        self._highlight = []
        self.page_map.highlight = []
        self.timelines.set_cursor(self.timelines.cursor, None, keep_layer=False)

    # ---- per-page details (asked for by the page map on hover/click) -------------------
    def _details(self, page: int) -> dict:
        st, eng = self.page_map.state, self.engine
        if eng is not None and st is not None and st.step >= eng.step_count and hasattr(eng, "pool"):
            return live_page_details(eng, page)
        tt = self._time_travel()
        gen = 0
        if tt is not None and st is not None:
            gen = sum(1 for ev in tt.events if ev[1] <= st.step and ev[2] == "allocated" and page in ev[3])
        return {"generation": gen, "note": "fill and prefix hash are kept for the live step only"}

    # ---- export ---------------------------------------------------------------------------
    def to_html(self, path: str | None = None, **kw) -> str:
        """One self-contained HTML file of these views (no CDN); returns the HTML."""
        from .static_html import dashboard_html
        text = dashboard_html(self, **kw)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text
