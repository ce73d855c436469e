"""A self-contained HTML report of a replay: plotly inlined (no CDN), one file to attach
to an incident ticket: pool timeline, waste, preemptions, request latencies, findings."""
from __future__ import annotations

import html
from pathlib import Path


def _figures(result):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    s = result.steps
    figs = []
    if len(s):
        f = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                          subplot_titles=("KV pool (pages)", "requests", "internal waste (slots in last pages)"))
        f.add_scatter(x=s["step"], y=s["pages_used"], name="used", row=1, col=1)
        f.add_scatter(x=s["step"], y=s["pages_cached"], name="cached-free", row=1, col=1)
        f.add_scatter(x=s["step"], y=s["num_running"], name="running", row=2, col=1)
        f.add_scatter(x=s["step"], y=s["num_waiting"], name="waiting", row=2, col=1)
        f.add_scatter(x=s["step"], y=s["num_preemptions"], name="preemptions (total)", row=2, col=1)
        if "waste_slots" in s:
            f.add_scatter(x=s["step"], y=s["waste_slots"], name="waste slots", row=3, col=1)
        f.update_layout(height=720, title="Pool timeline", margin=dict(l=40, r=20, t=60, b=30))
        figs.append(f)
    r = result.requests
    if len(r):
        f = go.Figure()
        f.add_histogram(x=r["ttft_s"], name="TTFT (s)", opacity=0.7)
        f.add_histogram(x=r["tpot_s"], name="TPOT (s)", opacity=0.7)
        f.update_layout(barmode="overlay", title="Request latency (virtual clock)", height=360)
        figs.append(f)
    return figs


def write_html_report(result, path, title: str = "PagedKV Workbench replay report") -> Path:
    import plotly.io as pio
    path = Path(path)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:sans-serif;margin:24px} table{border-collapse:collapse;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:3px 6px} .error,.critical{background:#fdd} .warn{background:#ffd}"
             "</style></head><body>", f"<h1>{html.escape(title)}</h1>"]
    st = result.steps
    n_req = len(result.requests)
    summary = {"mode": result.mode, "requests finished": n_req, "requests rejected": len(result.rejected),
               "steps": len(st), "peak pool usage": f"{st['usage'].max():.1%}" if len(st) else "n/a",
               "preemptions": int(st["num_preemptions"].iloc[-1]) if len(st) else 0,
               "wall time": f"{result.wall_s:.1f} s"}
    parts.append("<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                                     for k, v in summary.items()) + "</table>")
    for i, fig in enumerate(_figures(result)):
        parts.append(pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0), include_mathjax=False,
                                 config={"displaylogo": False}))
    parts.append("<h2>Findings</h2>")
    f = result.findings
    if f is None or len(f) == 0:
        parts.append("<p>No findings.</p>")
    else:
        rows = []
        for r in f.itertuples(index=False):
            rows.append(f"<tr class='{html.escape(r.severity)}'>" + "".join(
                f"<td>{html.escape(str(getattr(r, c)))}</td>"
                for c in ("severity", "probe", "kind", "step", "request_id", "layer", "page", "message", "hint")) + "</tr>")
        parts.append("<table><tr>" + "".join(f"<th>{c}</th>" for c in
                     ("severity", "probe", "kind", "step", "request", "layer", "page", "message", "hint")) + "</tr>"
                     + "".join(rows) + "</table>")
    if result.rejected:
        parts.append("<h2>Rejected requests</h2><ul>" + "".join(
            f"<li>{html.escape(str(i))}: {html.escape(why)}</li>" for i, why in result.rejected[:200]) + "</ul>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
