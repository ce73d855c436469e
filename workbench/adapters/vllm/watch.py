"""`kvwb watch`: a running vLLM on the terminal, then one HTML page of what was seen.

    conn = open_connection("http://127.0.0.1:8000", sanitizer="tcp://127.0.0.1:5590")
    try:
        rc = watch(conn, interval_s=1.0, report="watch.html")     # until Ctrl-C
    finally:
        conn.close()

watch() prints the connection's summary line every interval_s (rewritten in place with \\r
on a terminal, one line per interval otherwise), each finding as it arrives and each
problem (a wrong URL, a vLLM without KV events, a malformed message, ...) once. It returns
1 if a finding of severity error or worse was seen, else 0. The report is self-contained
(no CDN, no script): the summary, the findings, the problems, and the /metrics timeline as
an inline SVG.
"""
from __future__ import annotations

import html
import math
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from .connection import VllmConnection

POLL_S = 0.1                 # how often findings and problems are looked for between summary lines
MAX_POINTS = 2000            # per series in the report's SVG (a day at 1 s is 86 400 rows)


# ---- connecting ------------------------------------------------------------------------------
def check_url(url: str) -> str:
    """vLLM's server URL (http[s]://HOST[:PORT][/...]); ValueError naming what is wrong."""
    u = urlparse(url)
    try:
        u.port                                  # raises for a port that is not a number in range
    except ValueError as e:
        raise ValueError(f"vLLM URL {url!r}: {e}") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"vLLM URL {url!r}: give the server's base URL, e.g. http://127.0.0.1:8000")
    return url


def open_connection(url: str | None, kv_events: str | None = None, sanitizer: str | None = None,
                    kv_replay: str | None = None, interval_s: float = 1.0) -> VllmConnection:
    """A VllmConnection, every bad address (wrong form, not 127.0.0.1, a port already bound)
    raised as a ValueError of one sentence, with nothing left bound or running."""
    if url:
        check_url(url)
    if kv_replay and not kv_events:
        raise ValueError(f"KV replay address {kv_replay!r} given without a KV events address (--kv-events)")
    if not interval_s > 0:
        raise ValueError(f"interval {interval_s!r}: give a number of seconds > 0")
    try:
        return VllmConnection(url, kv_events=kv_events, sanitizer=sanitizer, kv_replay=kv_replay,
                              interval_s=interval_s)
    except ValueError:
        raise
    except OSError as e:                        # KVEventSubscriber.start: cannot bind / connect
        raise ValueError(str(e)) from None
    except Exception as e:                      # zmq.ZMQError and the like: still one sentence
        raise ValueError(f"cannot connect to vLLM: {type(e).__name__}: {e}") from None


# ---- the terminal ----------------------------------------------------------------------------
def finding_line(f) -> str:
    """One finding on one line: severity, probe, kind, request, block, message."""
    def v(x):
        return "-" if x is None or x == "" else str(x)
    return (f"[{f.severity}] {f.probe} {v(f.kind)} request {v(f.request_id)} block {v(f.page)}: "
            f"{' '.join(str(f.message).split())}")


class _Terminal:
    """Lines that stay (findings, problems) and a status line that is rewritten on a TTY."""

    def __init__(self, out):
        self.out = out
        try:
            self.tty = bool(out.isatty())
        except (AttributeError, ValueError, OSError):
            self.tty = False
        self.status_line: str | None = None     # shown at the bottom right now (TTY only)

    def _write(self, s: str) -> None:
        self.out.write(s)
        self.out.flush()

    def event(self, line: str) -> None:
        if self.tty and self.status_line is not None:
            self._write("\r\x1b[K" + line + "\n" + self._fit(self.status_line))
        else:
            self._write(line + "\n")

    def status(self, line: str) -> None:
        if self.tty:
            self.status_line = line
            self._write("\r" + self._fit(line) + "\x1b[K")
        else:
            self._write(line + "\n")

    def _fit(self, line: str) -> str:
        cols = shutil.get_terminal_size((120, 24)).columns
        return line if len(line) < cols else line[:max(1, cols - 2)] + "…"

    def end(self) -> None:
        if self.tty and self.status_line is not None:
            self._write("\n")
            self.status_line = None


# ---- watching --------------------------------------------------------------------------------
class _CtrlC:
    """Ctrl-C as a flag the loop reads between polls, not a KeyboardInterrupt raised wherever the main
    thread happens to be. A `kvwb watch` outlived its Ctrl-C once in the test suite; two ways it can, both
    closed by this: a process started with SIGINT ignored keeps it ignored (Python installs its handler
    only over the default), and an interrupt landing after a `with lock:` has taken its lock and before
    the block that releases it leaves the lock held for the report's last reads. A second Ctrl-C
    interrupts at once. Off the main thread (no signal handlers there) Ctrl-C stays a KeyboardInterrupt."""

    def __init__(self):
        self.hit = False
        self._installed = False
        self._old = None

    def __enter__(self) -> "_CtrlC":
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._on)     # also over an inherited SIG_IGN
            self._installed = True
        return self

    def _on(self, signum, frame) -> None:
        self.hit = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc) -> None:
        if self._installed:
            # the handler found, or Python's own where it was one set from C (signal() answers None
            # then): never leave ours, whose flag no loop reads any more
            signal.signal(signal.SIGINT, self._old if self._old is not None else signal.default_int_handler)


def watch(conn: VllmConnection, out=None, interval_s: float = 1.0, duration_s: float | None = None,
          report: str | Path | None = None) -> int:
    """Print the connection's state until Ctrl-C (or duration_s); write `report` on the way out.

    Returns 1 if any finding of severity error or worse was seen, else 0. Nothing the
    connection reports raises here; an OSError writing the report does."""
    out = sys.stdout if out is None else out
    interval_s = float(interval_s) if interval_s and interval_s > 0 else 1.0
    term = _Terminal(out)
    state = {"findings": 0, "checks": ""}
    seen_problems: set[str] = set()
    problems_log: list[tuple[float, str]] = []  # every distinct sentence seen, with when it first came
    started = time.time()
    t0 = time.monotonic()
    next_status = t0

    def note_problem(p: str) -> None:
        if p not in seen_problems:
            seen_problems.add(p)
            problems_log.append((time.time(), p))
            term.event(f"problem: {p}")

    def drain() -> None:
        try:
            fs = conn.findings
            for f in fs[state["findings"]:]:
                term.event(finding_line(f))
            state["findings"] = len(fs)
            for p in conn.problems():
                note_problem(p)
            line = conn.checks_line()                 # what the plugin runs on, each time it changes
            if conn.checks() and line != state["checks"]:
                state["checks"] = line
                term.event(line)
        except (OSError, KeyboardInterrupt):
            raise
        except Exception as e:                  # a view never takes the watch down
            note_problem(f"watch: {type(e).__name__}: {e}")

    def status() -> None:
        try:
            line = conn.summary_line()
        except Exception as e:
            note_problem(f"watch: summary: {type(e).__name__}: {e}")
            return
        term.status(line)

    try:
        with _CtrlC() as ctrl_c:
            while not ctrl_c.hit:
                now = time.monotonic()
                drain()
                if now >= next_status:
                    status()
                    next_status = max(next_status + interval_s, now + interval_s / 2)
                if duration_s is not None and now - t0 >= duration_s:
                    break
                wake = min(next_status, now + POLL_S)
                if duration_s is not None:
                    wake = min(wake, t0 + duration_s)
                time.sleep(max(0.0, wake - time.monotonic()))
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:                     # `kvwb watch ... | head`: stop printing, still report
        term = _Terminal(_Null())
    try:
        drain()
        status()
        term.end()
    except (KeyboardInterrupt, BrokenPipeError):
        pass
    if report:
        path = write_report(conn, report, problems=problems_log, started=started, ended=time.time())
        try:
            term.event(f"report: {path}")
        except BrokenPipeError:
            pass
    return 1 if any(f.at_least("error") for f in conn.findings) else 0


class _Null:
    def write(self, s):
        pass

    def flush(self):
        pass

    def isatty(self):
        return False


# ---- the report ------------------------------------------------------------------------------
FINDING_COLUMNS = (("severity", "severity"), ("probe", "probe"), ("kind", "kind"), ("step", "step"),
                   ("request_id", "request"), ("page", "block"), ("message", "message"), ("hint", "hint"))
# (panel title, [(series label, source, column)], value format); source "m": /metrics rows, "s": plugin steps
PANELS = (("KV-cache usage", [("vLLM gauge", "m", "kv_cache_usage"), ("plugin snapshots", "s", "usage")], "{:.0%}"),
          ("requests", [("running", "m", "running"), ("waiting", "m", "waiting")], "{:.0f}"),
          ("preemptions (total)", [("preemptions", "m", "preemptions")], "{:.0f}"),
          ("prefix cache hit rate (cumulative)", [("hits / queries", "m", "prefix_hit_rate")], "{:.0%}"))
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


def _e(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return html.escape(str(v))


def _num(v) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _series(conn) -> dict[str, list[tuple[float, float | None]]]:
    """{(source, column): [(t, value)]} from the scraped rows and the plugin's step headers."""
    out: dict = {}
    rows = conn.metrics.rows if conn.metrics is not None else []
    for r in rows:
        q, h = _num(r.get("prefix_queries")), _num(r.get("prefix_hits"))
        r = dict(r, prefix_hit_rate=h / q if q and h is not None else None)
        for _, panel, _ in PANELS:
            for _, src, col in panel:
                if src == "m":
                    out.setdefault(("m", col), []).append((r["t"], _num(r.get(col))))
    steps = list(conn.sanitizer.steps) if conn.sanitizer is not None else []
    for s in steps:
        nb, nf = _num(s.get("num_blocks")), _num(s.get("num_free"))
        if s.get("t") is not None:
            out.setdefault(("s", "usage"), []).append(
                (float(s["t"]), 1.0 - nf / max(1.0, nb - 1) if nb and nf is not None else None))
    return out


def timeline_svg(conn, width: int = 760, panel_h: int = 110) -> str:
    """The metrics timeline as one inline <svg>: a panel per PANELS entry, seconds on x."""
    data = _series(conn)
    ts = [t for pts in data.values() for t, _ in pts]
    if not ts:
        return "<p>No /metrics scrape or plugin snapshot arrived: no timeline.</p>"
    t0, t1 = min(ts), max(ts)
    span = max(t1 - t0, 1e-9)
    left, right, top, bottom = 64, 150, 18, 22
    pw = width - left - right
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{len(PANELS) * panel_h}" '
             f'font-family="sans-serif" font-size="11" role="img" aria-label="vLLM metrics timeline">']
    for i, (title, series, fmt) in enumerate(PANELS):
        y0 = i * panel_h + top
        ph = panel_h - top - bottom
        vals = [v for _, src, col in series for _, v in data.get((src, col), ()) if v is not None]
        lo = min([0.0] + vals)
        hi = max(vals) if vals else 1.0
        if "%" in fmt:
            hi = max(hi, 1.0)
        if hi <= lo:
            hi = lo + 1.0
        parts.append(f'<text x="{left}" y="{y0 - 5}" font-weight="bold">{html.escape(title)}</text>')
        parts.append(f'<rect x="{left}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>')
        parts.append(f'<text x="{left - 4}" y="{y0 + 9}" text-anchor="end">{html.escape(fmt.format(hi))}</text>')
        parts.append(f'<text x="{left - 4}" y="{y0 + ph}" text-anchor="end">{html.escape(fmt.format(lo))}</text>')
        parts.append(f'<text x="{left + pw}" y="{y0 + ph + 14}" text-anchor="end">{span:.1f} s</text>'
                     f'<text x="{left}" y="{y0 + ph + 14}">0 s</text>')
        for k, (label, src, col) in enumerate(series):
            pts = data.get((src, col), [])
            color = COLORS[k % len(COLORS)]
            parts.append(f'<text x="{left + pw + 8}" y="{y0 + 12 + 14 * k}" fill="{color}">'
                         f'{html.escape(label)}</text>')
            stride = max(1, math.ceil(len(pts) / MAX_POINTS))
            run: list[str] = []

            def flush(run=run, color=color):
                if len(run) == 1:
                    x, y = run[0].split(",")
                    parts.append(f'<circle cx="{x}" cy="{y}" r="2" fill="{color}"/>')
                elif run:
                    parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                                 f'points="{" ".join(run)}"/>')
                run.clear()
            for j in range(0, len(pts), stride):
                t, v = pts[j]
                if v is None:
                    flush()
                    continue
                x = left + (t - t0) / span * pw
                y = y0 + ph - (v - lo) / (hi - lo) * ph
                run.append(f"{x:.1f},{y:.1f}")
            flush()
    parts.append("</svg>")
    return "".join(parts)


def _local(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def report_html(conn, problems: list[tuple[float, str]] | None = None, started: float | None = None,
                ended: float | None = None, title: str | None = None) -> str:
    """The watch as one self-contained HTML page (no CDN, no script)."""
    title = title or f"kvwb watch: vLLM {conn.url or '(no /metrics URL)'}"
    problems = problems if problems is not None else [(time.time(), p) for p in conn.problems()]
    findings = conn.findings
    n_err = sum(f.at_least("error") for f in findings)
    summary = conn.summary()
    doors = []
    if conn.metrics is not None:
        m = conn.metrics
        doors.append(("/metrics", f"{m.metrics_url}: {m.scrapes} scrapes, {m.failures} failed, last good "
                                  f"{_local(m.last_ok)}"))
    if conn.kv is not None:
        snap = conn.kv.snapshot()
        lost = sum(not g.recovered for g in snap.gaps)
        doors.append(("KV events", f"{conn.kv.endpoint}: {snap.counters.get('batches', 0)} batches, "
                                   f"{len(snap.stored)} blocks stored now, {lost} lost gaps, last seq "
                                   f"{'-' if snap.last_seq is None else snap.last_seq}"))
    if conn.sanitizer is not None:
        s = conn.sanitizer
        procs = ", ".join(f"{p.get('process', '?')} (pid {p.get('pid', '?')})" for p in s.processes[:8])
        doors.append(("sanitizer", f"{s.address}: {s.messages} messages, {len(s.steps)} step snapshots, "
                                   f"{len(s.errors)} malformed or failed; processes: {procs or 'none yet'}"))
    rows = [("watched", f"{_local(started)} to {_local(ended)}"
                        + (f" ({ended - started:.1f} s)" if started is not None and ended is not None else "")),
            *doors,
            *((k, "-" if v is None else (f"{v:.1%}" if k == "kv_cache_usage" else v))
              for k, v in summary.items() if k != "t")]
    parts = [
        "<!DOCTYPE html>",
        f'<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>',
        "<style>body{font:13px sans-serif;margin:24px} table{border-collapse:collapse;font-size:12px}"
        "th,td{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top} th{background:#f4f4f4}"
        "tr.sev-error td,tr.sev-critical td{color:#a00000} tr.sev-warn td{color:#8a6400}"
        "pre{background:#f7f7f7;padding:6px;white-space:pre-wrap} li.problem{color:#b00020}</style>",
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<pre>{html.escape(conn.summary_line())}\n{html.escape(conn.checks_line())}</pre>",
        "<h2>Summary</h2><table>" + "".join(f"<tr><th>{html.escape(str(k))}</th><td>{_e(v)}</td></tr>"
                                            for k, v in rows) + "</table>",
        "<h2>Timeline</h2>", timeline_svg(conn),
        f"<h2>Findings ({len(findings)}, {n_err} at error or worse)</h2>",
    ]
    if findings:
        head = "".join(f"<th>{name}</th>" for _, name in FINDING_COLUMNS)
        body = "".join(f"<tr class='sev-{html.escape(f.severity)}'>"
                       + "".join(f"<td>{_e(getattr(f, attr))}</td>" for attr, _ in FINDING_COLUMNS) + "</tr>"
                       for f in findings)
        parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
    else:
        parts.append("<p>No findings.</p>")
    parts.append(f"<h2>Problems ({len(problems)})</h2>")
    if problems:
        parts.append("<ul>" + "".join(f"<li class='problem'>{_local(t)}: {html.escape(p)}</li>"
                                      for t, p in problems) + "</ul>")
    else:
        parts.append("<p>None: every door that was given answered as expected.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(conn, path: str | Path, **kw) -> Path:
    path = Path(path)
    path.write_text(report_html(conn, **kw), encoding="utf-8")
    return path
