"""Live views without a browser: the bytes the page map sends, details on demand, one cursor
across the views, the 10 Hz throttle, the findings table, and the static HTML export.

Messages are caught on a recording comm put where the kernel's comm would be, so the
tests see what ipywidgets really sends (state JSON + binary buffers) and feed messages
back through the same path the browser uses.
"""
import base64
import json
import re
import uuid

import numpy as np
import pytest

from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.events import BatchPacked, StepFinished
from workbench.findings import Finding, findings_frame
from workbench.trace import replay
from workbench.trace.schema import Trace, TraceRecord
from workbench.trace.timetravel import PoolState, TimeTravel
from workbench.widgets import Dashboard, FindingsTable, PageMap, Throttle, encode
from workbench.widgets.dashboard import live_state
from workbench.widgets.page_map import CACHED_RGB, FREE_RGB, PALETTE, layout, live_page_details

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


class RecordingComm:
    """Stands where the kernel's comm stands: keeps what the widget sends, delivers what the browser would."""

    def __init__(self):
        self.comm_id = uuid.uuid4().hex
        self.sent = []
        self._handler = None

    def send(self, data=None, buffers=None, **_kw):
        self.sent.append((data, [bytes(b) for b in (buffers or [])]))

    def on_msg(self, fn):
        self._handler = fn

    def close(self, *a, **kw):
        pass

    def deliver(self, content):
        self._handler({"content": {"data": {"method": "custom", "content": content}}, "buffers": []})

    def updates(self, key):
        """The buffers sent for trait `key`, in order."""
        out = []
        for data, bufs in self.sent:
            if data.get("method") == "update":
                for path, buf in zip(data.get("buffer_paths", []), bufs):
                    if path == [key]:
                        out.append(buf)
        return out

    def customs(self):
        return [d["content"] for d, _ in self.sent if d.get("method") == "custom"]


def recorded(widget):
    widget.comm = RecordingComm()
    return widget.comm


def dashboards_listening(eng) -> bool:
    return any(isinstance(getattr(f, "__self__", None), Dashboard) for f in eng.bus._subs.get(StepFinished, []))


@pytest.fixture()
def engine(tiny_llama_dir):
    return Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64))


def shared_prefix_run(eng, steps=4):
    """One request to completion (its full pages stay cached), then three that share its prefix
    (prefix-cache hits: shared pages) left running: every page state is on the map."""
    prefix = list(range(3, 43))
    eng.generate([prefix + [50, 51]], GREEDY)
    for i in range(3):
        eng.add_request(prefix + [60 + i] * 5, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(steps):
        eng.step()


# ---- the page map ------------------------------------------------------------------------
def test_bytes_sent_for_a_known_pool_state():
    st = PoolState.empty(8, step=5)
    st.cached[1] = True                                       # cached-free
    st.ref[2], st.owner[2] = 1, 7                             # owned by request 7
    st.ref[3], st.owner[3], st.shared_owners[3] = 2, 7, (7, 9)   # shared by 7 and 9
    st.ref[4], st.owner[4] = 1, 70                            # request 70: the hue wheel wraps onto 7's
    st.ref[5], st.owner[5] = 1, 8                             # request 8: a hue of its own
    w = PageMap(8)
    comm = recorded(w)
    assert w.show(st)
    hue7, hue8 = 1 + 7 % 63, 1 + 8 % 63
    expected = bytes([0, 1, 2 | hue7 << 2, 3 | hue7 << 2, 2 | hue7 << 2, 2 | hue8 << 2, 0, 0])
    # What went over the wire: one binary buffer of one byte per page, not JSON.
    assert comm.updates("codes") == [expected]
    data, _ = comm.sent[-1]
    assert "codes" not in data["state"] and data["state"]["step"] == 5
    # The same state again: nothing but the step counter travels.
    assert not w.show(st)
    assert comm.updates("codes") == [expected]
    # The colours the browser paints with (palette[code]).
    assert w.color_of(0) == FREE_RGB and w.color_of(1) == CACHED_RGB
    assert w.color_of(2) == w.color_of(4) != w.color_of(5)     # a hue per request
    assert sum(w.color_of(3)) < sum(w.color_of(2))              # shared: the owner's hue, darker
    assert len({tuple(PALETTE[2 | h << 2]) for h in range(1, 64)}) == 63


def test_codes_of_a_live_pool_match_refcounts_and_owners(engine):
    shared_prefix_run(engine)
    st = PoolState.from_engine(engine)
    fast = live_state(engine)                                 # what the dashboard draws live
    for name in ("ref", "owner", "cached"):
        assert (getattr(fast, name) == getattr(st, name)).all(), name
    assert fast.shared_owners == st.shared_owners and fast.step == st.step
    w = PageMap(engine.num_pages)
    w.show(st)
    codes = np.frombuffer(w.codes, np.uint8)
    ref = np.asarray(engine.pool.ref)
    state = codes & 3
    assert ((state == 3) == (ref > 1)).all() and ((state == 2) == (ref == 1)).all()
    cached = np.array([engine.pool.is_free(p) and engine.pool.page_hash[p] is not None
                       for p in range(engine.num_pages)])
    assert ((state == 1) == cached).all()
    assert {0, 1, 2, 3} <= set(state.tolist())               # the scenario shows every state
    for seq in engine.scheduler.running:
        for p in seq.pages:
            if ref[p] == 1:
                assert codes[p] >> 2 == 1 + seq.request_id % 63


def test_page_map_at_131072_pages_sends_one_byte_a_page():
    n = 131_072
    rng = np.random.default_rng(0)
    st = PoolState.empty(n)
    st.ref[:] = rng.integers(0, 3, n)
    st.owner[:] = np.where(st.ref > 0, rng.integers(0, 5000, n), -1)
    w = PageMap(n, width=640, max_height=360)
    comm = recorded(w)
    w.show(st)
    [buf] = comm.updates("codes")
    assert len(buf) == n and buf == encode(st.states, st.owner)
    cols, cell = layout(n, 640, 360)
    assert cols * cell <= 640 and -(-n // cols) * cell <= 360 and cell >= 1


def test_details_come_on_demand_from_the_pool(engine):
    shared_prefix_run(engine)
    w = PageMap(engine.num_pages, details=lambda p: live_page_details(engine, p))
    w.show(PoolState.from_engine(engine))
    comm = recorded(w)
    pool = engine.pool
    shared = next(p for p in range(engine.num_pages) if pool.ref[p] > 1)
    comm.deliver({"type": "hover", "page": shared})           # what the canvas sends on mouse-over
    [msg] = comm.customs()
    d = msg["detail"]
    holders = sorted(s.request_id for s in engine.scheduler.running if shared in s.pages)
    assert d["page"] == shared and d["state"] == "shared" and d["ref"] == pool.ref[shared] == len(holders)
    assert sorted(d["owners"]) == holders
    assert d["generation"] == pool.generation[shared] and d["fill"] == "16/16"
    assert d["prefix_hash"] == f"{pool.page_hash[shared] & (2**64 - 1):016x}"
    comm.deliver({"type": "click", "page": 0})
    assert w.selected == 0 and comm.customs()[-1]["detail"]["page"] == 0


# ---- the dashboard -------------------------------------------------------------------------
def test_one_cursor_moves_every_view(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64))
    wb = Workbench(eng).attach("page_table")
    dash = wb.dashboard()
    assert dashboards_listening(eng)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (10, 20, 30)]
    with faults.inject(eng, "page_out_of_range", request_id=1):
        eng.generate(prompts, GREEDY)
    shared_prefix_run(eng, steps=3)
    dash.refresh(force=True)                                  # the trailing edge the throttle skipped
    head = eng.step_count
    assert dash.follow.value and dash.slider.max == dash.slider.value == head
    live = PoolState.from_engine(eng)
    assert dash.page_map.step == head and dash.page_map.codes == encode(live.states, live.owner)
    assert dash.timelines.cursor_x() == head

    tt = TimeTravel(wb.log, eng.num_pages)
    for s in (2, head // 2):                                  # scrub back: time travel
        dash.slider.value = s
        st = tt.state_at(s)
        assert not dash.follow.value
        assert dash.page_map.step == s and dash.page_map.codes == encode(st.states, st.owner)
        assert dash.timelines.cursor == s and dash.timelines.cursor_x() == s

    # Picking a finding moves the cursor to its step and rings the page it names.
    rows = dash.table.rows()
    i = next(i for i, r in enumerate(rows) if r["kind"] == "page-out-of-range")
    row = dash.table.select(i)
    meant = row["evidence"]["page_meant"]
    assert dash.slider.value == row["step"] == dash.page_map.step == dash.timelines.cursor_x()
    assert dash.page_map.highlight == [meant]                 # page n (outside the pool) is not drawn
    assert dash.page_map.codes[meant] & 3 == 2                # the page it meant was owned at that step

    # A click on a timeline (the message plotly.js sends) moves the slider and the map.
    dash.timelines.fig._handler_js2py_pointsCallback({"new": {
        "event_type": "plotly_click",
        "points": {"xs": [3], "ys": [1], "point_indexes": [2], "trace_indexes": [0]}}})
    assert dash.slider.value == 3 == dash.page_map.step == dash.timelines.cursor_x()
    dash.close()
    assert not dashboards_listening(eng)


def test_steps_within_100ms_cause_at_most_one_refresh(engine):
    now = [0.0]
    wb = Workbench(engine)
    dash = wb.dashboard(clock=lambda: now[0])
    seen = []
    engine.bus.subscribe(StepFinished, seen.append)
    engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=30, ignore_eos=True))
    now[0] = 1.0
    before = dash.refreshes
    for _ in range(25):                                       # 25 steps, the clock standing at 1.0 s
        engine.step()
    assert len(seen) == 25
    assert dash.refreshes - before == 1 and dash.skipped == 24
    now[0] = 1.09                                             # 90 ms later: still throttled
    engine.step()
    assert dash.refreshes - before == 1
    now[0] = 1.11
    engine.step()
    assert dash.refreshes - before == 2 and dash.slider.value == engine.step_count
    dash.close()


def test_a_slow_refresh_waits_longer():
    now = [0.0]
    th = Throttle(min_interval_s=0.1, max_share=0.1, clock=lambda: now[0])
    assert th.due()
    now[0] = 0.05                                             # the refresh took 50 ms
    th.done(started=0.0)
    now[0] = 0.4
    assert not th.due()                                       # 50 ms may cost at most 10% of 500 ms
    now[0] = 0.5
    assert th.due()


def test_a_finished_replay_opens_as_time_travel_with_play():
    # Twelve requests sharing a 3-block prefix (Mooncake-style hash ids), replayed in simulate mode.
    recs = [TraceRecord(i, arrival_s=0.02 * i, output_len=24, prompt_len=64, hash_ids=[1, 2, 3, 100 + i],
                        hash_block_size=16) for i in range(12)]
    res = replay(Trace(recs), EngineConfig(num_pages=48, max_num_seqs=4), "simulate", progress=False)
    # A finding that names a step, a layer and a page, as the fp16 probe reports one.
    res.findings = findings_frame([Finding("fp16_overflow", "error", "layer 1: K absmax 70000 > 65504",
                                           "scale per page", "fp16-kv-overflow", step=5, layer=1, page=3)])
    dash = Dashboard.from_replay(res)
    last = int(res.log.frame(StepFinished)["step"].max())
    assert not dash.follow.value and dash.slider.max == dash.slider.value == last
    tt = TimeTravel(res.log, 48)
    shared_seen = False
    for s in range(1, last + 1, 3):
        dash.play.value = s                                  # what the Play button does, tick by tick
        st = tt.state_at(s)
        assert dash.slider.value == s == dash.page_map.step == dash.timelines.cursor_x()
        assert dash.page_map.codes == encode(st.states, st.owner)
        shared_seen |= 3 in (np.frombuffer(dash.page_map.codes, np.uint8) & 3)
    assert shared_seen                                       # the prefix the trace shares shows as shared
    dash.table.select(0)
    assert dash.slider.value == 5 == dash.page_map.step and dash.page_map.highlight == [3]
    assert dash.timelines.layer_marked() == 1 and dash.timelines.cursor_x() == 5
    assert len(dash.timelines.segments) == len(res.log.frame(BatchPacked))


def test_live_while_a_full_replay_plays(engine):
    wb = Workbench(engine)
    dash = wb.dashboard()
    recs = [TraceRecord(i, arrival_s=0.01 * i, output_len=6, prompt_len=24 + 8 * i) for i in range(5)]
    replay(Trace(recs), wb, "full", progress=False)
    assert dash.refreshes >= 2 and dash.follow.value
    dash.refresh(force=True)
    assert dash.slider.value == engine.step_count == dash.page_map.step
    assert dash.timelines.cols["step"][-1] == engine.step_count
    dash.stop()                                              # now a time-travel view over the log
    assert not dash.follow.value
    dash.goto(2)
    st = TimeTravel(wb.log, engine.num_pages).state_at(2)
    assert dash.page_map.codes == encode(st.states, st.owner)


def test_findings_table_sorts_filters_and_names_pages():
    fs = [Finding("pool", "warn", "pool at 97% for 8 steps", "size the pool", "pool-usage", step=30),
          Finding("page_table", "critical", "request 3 reads page 70, outside the pool", "validate ids",
                  "page-out-of-range", step=12, request_id=3, page=70, evidence={"page_meant": 5}),
          Finding("fp16_overflow", "error", "layer 1 K absmax 70000 > 65504", "scale per page",
                  "fp16-kv-overflow", step=20, layer=1),
          Finding("bandwidth", "info", "decode at 20% of peak", "check the page size", "low-bandwidth")]
    t = FindingsTable(findings_frame(fs))
    assert [r["kind"] for r in t.rows()] == ["page-out-of-range", "fp16-kv-overflow", "pool-usage", "low-bandwidth"]
    t.sort.value, t.descending.value = "severity", True
    assert [r["severity"] for r in t.rows()] == ["critical", "error", "warn", "info"]
    t.severity.value = "error"
    assert {r["probe"] for r in t.rows()} == {"page_table", "fp16_overflow"}
    t.severity.value, t.query.value = "all", "page size"
    assert [r["kind"] for r in t.rows()] == ["low-bandwidth"]
    t.query.value = ""
    picked = []
    t.on_select.append(picked.append)
    row = t.select(0)                                         # critical first (severity, descending)
    assert picked == [row] and row["kind"] == "page-out-of-range" and row["pages"] == [5, 70]


def test_static_html_is_self_contained_and_carries_the_page_map(engine, tmp_path):
    wb = Workbench(engine)
    shared_prefix_run(engine)
    path = tmp_path / "incident.html"
    text = wb.export_html(str(path))
    assert path.read_text(encoding="utf-8") == text
    assert not re.search(r"<script[^>]+src=", text) and not re.search(r"<link[^>]+href=[\"']http", text)
    from plotly.offline import get_plotlyjs
    assert get_plotlyjs()[:300] in text                        # plotly.js inlined, not fetched
    data = json.loads(re.search(r'<script id="kvwb-data" type="application/json">(.*?)</script>',
                                text, re.S).group(1))
    head = engine.step_count
    steps = [f["step"] for f in data["frames"]]
    assert steps[0] == 0 and steps[-1] == head
    live = PoolState.from_engine(engine)
    assert base64.b64decode(data["frames"][-1]["codes"]) == encode(live.states, live.owner)
    assert data["frames"][-1]["counts"] == live.counts()
    assert not dashboards_listening(engine)                  # the export left nothing subscribed


def test_the_ring_goes_with_its_finding():
    # A picked finding rings its page and marks its layer while it is among the findings: a new
    # finding arriving keeps them, a reset of the findings (wb.reset()) takes them away.
    recs = [TraceRecord(i, arrival_s=0.02 * i, output_len=12, prompt_len=40) for i in range(6)]
    res = replay(Trace(recs), EngineConfig(num_pages=48, max_num_seqs=4), "simulate", progress=False)
    hit = Finding("fp16_overflow", "error", "layer 1: K absmax 70000 > 65504", "scale per page",
                  "fp16-kv-overflow", step=5, layer=1, page=3)
    shown = [findings_frame([hit])]
    dash = Dashboard(res.log, 48, findings=lambda: shown[0], live=False)
    dash.table.select(0)
    assert dash.page_map.highlight == [3] and dash.timelines.layer_marked() == 1
    later = Finding("pool", "warn", "usage 0.96", "more pages", "pool-usage", step=9)
    shown[0] = findings_frame([hit, later])
    dash.refresh(force=True)
    assert dash.table.selected is not None and dash.page_map.highlight == [3]
    assert dash.timelines.layer_marked() == 1
    shown[0] = findings_frame([])                            # the findings were reset
    dash.refresh(force=True)
    assert dash.table.selected is None and dash.page_map.highlight == []
    assert dash.timelines.layer_marked() is None
    dash.goto(2)                                             # and stays gone as the cursor moves
    assert dash.page_map.step == 2 and dash.page_map.highlight == []
    dash.close()


@pytest.mark.parametrize("max_points", [2000, 2])               # every step drawn; steps bucketed
def test_non_finite_kv_is_drawn_as_overflow_never_sent_as_nan(max_points):
    # K/V that went inf or NaN (past fp16's range) have the worst headroom there is: the heatmap draws
    # them above the scale's top, and the figure carries no NaN (not JSON: the kernel warns on each message).
    from workbench.event_log import EventLog
    from workbench.events import EventBus, KVWritten
    from workbench.widgets.timelines import NONFINITE_LOG10, Timelines
    bus = EventBus()
    tl = Timelines(EventLog(bus), max_points=max_points)
    for step in (1, 2, 3):
        for layer, (k, v) in enumerate([(6.5504, 1.0), (float("nan"), float("nan")), (float("inf"), 1.0)]):
            bus.emit(KVWritten(step, 0, layer, k, v, 4))
    tl.refresh(force=True)
    z = np.asarray(tl.fig.data[9].z, dtype=float)
    assert z.shape[0] == 3 and np.isfinite(z).all()
    assert np.allclose(z[0], -4.0) and (z[1:] == NONFINITE_LOG10).all()
    json.dumps(z.tolist(), allow_nan=False)
