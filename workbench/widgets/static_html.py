"""Static export: the dashboard's views as one self-contained HTML file (no CDN, no kernel).

For an incident ticket: plotly.js is inlined, the timelines are the dashboard's own
figure, the page map is a canvas drawn by the same page_map.js the widget uses, from
one-byte-per-page frames embedded as base64 (the cursor's step plus up to `max_frames`
steps spread over the run, within `max_bytes`), with a slider to scrub them. The
findings table sorts by a click on a header, filters as you type, and a click on a
finding jumps the page map to its step and rings its pages.
"""
from __future__ import annotations

import base64
import html
import json

import numpy as np

from ..trace.timetravel import STATE_NAMES
from .findings_table import pages_named
from .page_map import JS, PALETTE, encode

TABLE_COLUMNS = ["step", "severity", "probe", "kind", "request_id", "layer", "page", "message", "hint"]


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def frame_steps(head: int, cursor: int, max_frames: int) -> list[int]:
    steps = set(np.linspace(0, head, min(max_frames, head + 1)).round().astype(int).tolist()) if head >= 0 else set()
    steps.add(int(cursor))
    return sorted(steps)


def _cell(v) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return ""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return html.escape(str(v))


def findings_rows(dash) -> tuple[str, list]:
    """(the table's <tbody> rows, per-row [step, pages]) for the embedded findings."""
    df = dash.table.frame
    body, meta = [], []
    for r in df.to_dict("records"):
        step = r.get("step")
        meta.append([None if step is None or step != step else int(step), pages_named(r)])
        tds = "".join(f"<td>{_cell(r.get(c))}</td>" for c in TABLE_COLUMNS)
        body.append(f"<tr class='sev-{html.escape(str(r.get('severity')))}'>{tds}</tr>")
    return "\n".join(body), meta


def dashboard_html(dash, max_frames: int = 64, max_bytes: int = 24_000_000, title: str | None = None) -> str:
    import plotly.graph_objects as go
    import plotly.io as pio
    from plotly.offline import get_plotlyjs
    title = title or dash.title
    n = dash.num_pages
    head, cursor = dash.slider.max, dash.slider.value
    frames = []
    budget = max(1, max_bytes // max(1, n))
    for step in frame_steps(head, cursor, min(max_frames, budget)):
        st = dash.state_at(step)
        frames.append({"step": step, "codes": _b64(encode(st.states, st.owner)), "counts": st.counts()})
    now = dash.state_at(cursor)
    owners = {int(p): list(o) for p, o in now.owner_sets().items()}
    fig_html = pio.to_html(go.Figure(dash.timelines.fig), include_plotlyjs=False, full_html=False,
                           div_id="kvwb-timelines", config={"responsive": True})
    rows, meta = findings_rows(dash)
    data = {"numPages": n, "cols": dash.page_map.cols, "cell": dash.page_map.cell, "palette": _b64(PALETTE.tobytes()),
            "frames": frames, "cursor": cursor, "highlight": dash.page_map.highlight, "owners": owners,
            "ownersStep": cursor, "states": list(STATE_NAMES), "findings": meta}
    heads = "".join(f"<th data-col='{i}'>{c}</th>" for i, c in enumerate(TABLE_COLUMNS))
    page_map_js = JS.read_text(encoding="utf-8")
    data_json = json.dumps(data).replace("</", "<\\/")          # never end the <script> early
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font: 13px sans-serif; margin: 16px; }}
table {{ border-collapse: collapse; font-size: 12px; }} th, td {{ border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }}
th {{ cursor: pointer; background: #f4f4f4; }} tr.sev-error td, tr.sev-critical td {{ color: #a00000; }}
tr.sev-warn td {{ color: #8a6400; }} tbody tr:hover {{ background: #eef; cursor: pointer; }}
#kvwb-page-map canvas {{ image-rendering: pixelated; display: block; margin: 4px 0; }}
</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head><body>
<h2>{html.escape(title)}</h2>
<p>Exported from the PagedKV Workbench dashboard: step {cursor} of {head}; {n} pages; {len(meta)} findings.
Page colours: grey free, blue cached-free, a hue per owner request (darker: shared); red ring: pages the selected finding names.</p>
<div id="kvwb-page-map"><div><input id="kvwb-step" type="range" min="0" max="{len(frames) - 1}" style="width:480px">
<span id="kvwb-step-label"></span></div><canvas class="kvwb-page-map"></canvas><div id="kvwb-page-info" style="font-family:monospace;min-height:1.4em"></div></div>
<h3>Findings</h3>
<input id="kvwb-filter" placeholder="filter" style="width:320px">
<table id="kvwb-findings"><thead><tr>{heads}</tr></thead><tbody>
{rows}
</tbody></table>
<h3>Timelines</h3>
{fig_html}
<script id="kvwb-data" type="application/json">{data_json}</script>
<script type="module">
{page_map_js}
const D = JSON.parse(document.getElementById("kvwb-data").textContent);
const pal = bytesOf(D.palette);
const frames = D.frames.map(f => ({{ ...f, bytes: bytesOf(f.codes) }}));
const canvas = document.querySelector("#kvwb-page-map canvas");
const range = document.getElementById("kvwb-step"), label = document.getElementById("kvwb-step-label");
const info = document.getElementById("kvwb-page-info");
let highlight = D.highlight, current = 0;
function show(i) {{
  current = i; range.value = i;
  const f = frames[i];
  draw(canvas, {{ codes: f.bytes, palette: pal, cols: D.cols, cell: D.cell, numPages: D.numPages, highlight }});
  canvas.dataset.step = f.step;
  const c = f.counts;
  label.textContent = ` step ${{f.step}}: ${{c.owned}} owned, ${{c.shared}} shared, ${{c.cached}} cached, ${{c.free}} free`;
  const plot = document.getElementById("kvwb-timelines");
  if (window.Plotly && plot && plot.layout && plot.layout.shapes && plot.layout.shapes.length) {{
    Plotly.relayout(plot, {{ "shapes[0].x0": f.step, "shapes[0].x1": f.step }});
  }}
}}
function nearest(step) {{
  let best = 0;
  frames.forEach((f, i) => {{ if (Math.abs(f.step - step) < Math.abs(frames[best].step - step)) best = i; }});
  return best;
}}
range.addEventListener("input", () => show(+range.value));
canvas.addEventListener("mousemove", (e) => {{
  const p = pageAt(canvas, D.cols, D.cell, D.numPages, e);
  if (p < 0) {{ info.textContent = ""; return; }}
  const f = frames[current];
  let text = `page ${{p}} · ${{D.states[f.bytes[p] & 3]}}`;
  if (f.step === D.ownersStep && D.owners[p]) text += ` · owner request(s) ${{D.owners[p].join(", ")}}`;
  info.textContent = text + ` · step ${{f.step}}`;
}});
const tbody = document.querySelector("#kvwb-findings tbody");
[...tbody.rows].forEach((tr, i) => tr.addEventListener("click", () => {{
  const [step, pages] = D.findings[i];
  highlight = pages;
  show(step === null ? current : nearest(step));
}}));
document.querySelectorAll("#kvwb-findings th").forEach(th => th.addEventListener("click", () => {{
  const col = +th.dataset.col, asc = th.dataset.asc !== "1";
  th.dataset.asc = asc ? "1" : "0";
  const rows = [...tbody.rows];
  const key = (tr) => {{ const t = tr.cells[col].textContent; const x = parseFloat(t); return t === "" ? null : (isNaN(x) ? t : x); }};
  rows.sort((a, b) => {{
    const x = key(a), y = key(b);
    if (x === null) return 1; if (y === null) return -1;
    return (x < y ? -1 : x > y ? 1 : 0) * (asc ? 1 : -1);
  }});
  rows.forEach(r => tbody.appendChild(r));
}}));
document.getElementById("kvwb-filter").addEventListener("input", (e) => {{
  const q = e.target.value.toLowerCase();
  [...tbody.rows].forEach(tr => {{ tr.style.display = tr.textContent.toLowerCase().includes(q) ? "" : "none"; }});
}});
show(nearest(D.cursor));
</script>
</body></html>
"""
