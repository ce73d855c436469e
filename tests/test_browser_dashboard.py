"""The dashboard in a real JupyterLab in a real browser (Debian's Chromium, driven by Playwright).

JupyterLab runs headless on 127.0.0.1 over a temporary folder holding one notebook: it
loads SmolLM2, builds wb.dashboard(), runs requests that leave pages in every state, and
prints which colour a few known pages must have. The test runs the notebook in Chromium
and checks, from the DOM and the pixels: the page-map canvas is drawn (not blank) and
those pages have their state's colour (on the canvas and in a screenshot); the plotly
timelines rendered as SVG; dragging the step slider to 0 redraws the page map as the
empty pool; and the static HTML export draws the same colours offline. Screenshots go
to test-artifacts/. JupyterLab, its kernel and the browser are stopped even on failure.
"""
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"

pytestmark = [
    pytest.mark.ui,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium); "
                              "Playwright cannot download a browser here"),
]

CELLS = [
    """\
import json
from workbench import Engine, EngineConfig, SamplingParams, Workbench
eng = Engine.from_default(EngineConfig(num_pages=96))
wb = Workbench(eng).attach("pool", "fp16_overflow", "lock_contention", "page_table")
dash = wb.dashboard()
dash""",
    """\
prefix = "You are a careful on-call engineer. Read the page table, the block tables and the pool, then answer. " * 2
# Finished first: the second's full pages stay cached-free, the first's are shared below.
wb.run([prefix + "What is a KV page?", "An unrelated request about block tables, bound versions and checksums. " * 3],
       SamplingParams(max_tokens=2, ignore_eos=True))
for q in ("Why share pages?", "What is cu_seqlens?", "Why fp16 overflow?"):
    eng.add_request(prefix + q, SamplingParams(max_tokens=64, ignore_eos=True))
for _ in range(2):
    eng.step()""",
    """\
dash.refresh(force=True)
pm, st = dash.page_map, dash.page_map.state
known = {}
for p, s in enumerate(st.states.tolist()):
    known.setdefault(s, p)
wb.export_html("incident.html")
print("KVWB-READY " + json.dumps({
    "step": pm.step, "cols": pm.cols, "cell": pm.cell,
    "pages": [{"page": p, "state": int(s), "ref": int(st.ref[p]), "rgb": pm.color_of(p), "xy": pm.cell_center(p)}
              for s, p in sorted(known.items())],
}))""",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, method: str = "GET", body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        body = r.read()
    return json.loads(body) if body else None


@pytest.fixture()
def lab(tmp_path):
    """A headless JupyterLab over tmp_path (token-less, 127.0.0.1 only); yields its URL."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "dashboard.ipynb")
    # No "get notified about Jupyter news?" toast over the page.
    note = tmp_path / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    note.parent.mkdir(parents=True)
    note.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "jupyterlab.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.token=", "--ServerApp.password=",
         "--ip=127.0.0.1", f"--port={port}", "--allow-root", f"--ServerApp.root_dir={tmp_path}",
         "--ServerApp.disable_check_xsrf=True", "--LabApp.expose_app_in_browser=True", f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
         f"--LabApp.user_settings_dir={tmp_path / 'settings'}", "--LabApp.news_url=",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                http(f"{url}/api/status")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text()[-3000:])
                time.sleep(0.3)
        # Start the notebook's kernel before the page opens: the page joins this session instead
        # of asking which kernel to start.
        http(f"{url}/api/sessions", "POST", {"path": "dashboard.ipynb", "name": "dashboard.ipynb", "type": "notebook",
                                             "kernel": {"name": "python3"}})
        yield url, tmp_path
    finally:
        try:                                     # kernels run in sessions of their own: stop them first
            for k in http(f"{url}/api/kernels") or []:
                http(f"{url}/api/kernels/{k['id']}", "DELETE")
        except OSError:
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        log.close()


CANVAS_RGB = """(c, xy) => {
  const d = c.getContext('2d').getImageData(xy[0], xy[1], 1, 1).data; return [d[0], d[1], d[2]]; }"""
CANVAS_STATS = """(c) => {
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  const colours = new Set(); let h = 0;
  for (let i = 0; i < d.length; i += 4) { const v = (d[i] << 16) | (d[i+1] << 8) | d[i+2]; colours.add(v); h = (h * 31 + v) | 0; }
  return {width: c.width, height: c.height, colours: colours.size, hash: h}; }"""
# Decode a PNG screenshot in the page itself and read pixels from it (no imaging library needed).
PNG_RGB = """async ([b64, points]) => {
  const img = new Image(); img.src = 'data:image/png;base64,' + b64; await img.decode();
  const c = document.createElement('canvas'); c.width = img.width; c.height = img.height;
  const g = c.getContext('2d'); g.drawImage(img, 0, 0);
  return points.map(([x, y]) => Array.from(g.getImageData(x, y, 1, 1).data.slice(0, 3))); }"""


def close(a, b, tol=3):
    return all(abs(int(x) - int(y)) <= tol for x, y in zip(a, b))


def check_known_pages(page, canvas, known, what):
    for k in known:
        got = canvas.evaluate(CANVAS_RGB, k["xy"])
        assert close(got, k["rgb"]), f"{what}: page {k['page']} (state {k['state']}) is {got}, want {k['rgb']}"
    shot = canvas.screenshot()
    got = page.evaluate(PNG_RGB, [base64.b64encode(shot).decode(), [k["xy"] for k in known]])
    for k, rgb in zip(known, got):
        assert close(rgb, k["rgb"]), f"{what} screenshot: page {k['page']} is {rgb}, want {k['rgb']}"


def test_dashboard_renders_and_scrubs_in_chromium(lab):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    url, root = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300}, device_scale_factor=1)
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{url}/lab/tree/dashboard.ipynb", timeout=60_000)
            page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook')", timeout=60_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=30_000)
            page.wait_for_function(
                "() => { const w = window.jupyterapp.shell.currentWidget;"
                " return w && w.sessionContext && w.sessionContext.isReady && w.sessionContext.session &&"
                " w.sessionContext.session.kernel && w.sessionContext.session.kernel.status === 'idle'; }",
                timeout=60_000)
            # Not awaited: the command's promise settles only when every cell has run.
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            ready = page.locator(".jp-OutputArea-output", has_text="KVWB-READY")
            try:
                ready.wait_for(timeout=120_000)
            except Exception:
                errs = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
                raise AssertionError("the notebook did not finish: " + " | ".join(errs.all_inner_texts())[-2000:]
                                     + f" page errors: {errors}")
            info = json.loads(ready.inner_text().split("KVWB-READY", 1)[1].strip())
            known = info["pages"]
            assert {k["state"] for k in known} == {0, 1, 2, 3}, known      # free, cached, owned, shared

            # The page map: drawn, at the final step, each known page in its state's colour.
            canvas = page.locator(".kvwb-page-map canvas")
            assert canvas.count() == 1
            page.wait_for_function("(s) => document.querySelector('.kvwb-page-map canvas').dataset.step == s",
                                   arg=str(info["step"]), timeout=30_000)
            canvas.scroll_into_view_if_needed()
            stats = canvas.evaluate(CANVAS_STATS)
            assert stats["colours"] >= 5 and stats["width"] == info["cols"] * info["cell"], stats
            check_known_pages(page, canvas, known, "live page map")
            head = page.locator(".kvwb-page-map-head").inner_text()
            assert f"step {info['step']}" in head
            # Hover on a shared page: the kernel answers with its details (asked for on demand).
            shared = next(k for k in known if k["state"] == 3)
            canvas.hover(position={"x": shared["xy"][0], "y": shared["xy"][1]})
            page.wait_for_function("() => document.querySelector('.kvwb-page-info').textContent.includes('prefix_hash')",
                                   timeout=30_000)
            detail = page.locator(".kvwb-page-info").inner_text()
            assert f"page {shared['page']} · shared · owner requests" in detail and f"ref {shared['ref']}" in detail, detail
            page.screenshot(path=str(ARTIFACTS / "browser_dashboard.png"), full_page=True)

            # The timelines: plotly drew SVG with line and bar traces.
            plots = page.locator(".kvwb-dashboard .js-plotly-plot")
            assert plots.count() >= 1
            svg = plots.first.locator("svg.main-svg")
            assert svg.count() >= 1
            assert plots.first.locator(".scatterlayer .trace path.js-line").count() >= 5
            assert plots.first.locator(".barlayer .trace path").count() >= 1

            # Drag the step slider to its start: the page map redraws as the empty pool.
            handle = page.locator(".kvwb-step-slider .noUi-handle")
            track = page.locator(".kvwb-step-slider .noUi-target")
            hb, tb = handle.bounding_box(), track.bounding_box()
            page.mouse.move(hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2)
            page.mouse.down()
            page.mouse.move(tb["x"] - 20, hb["y"] + hb["height"] / 2, steps=8)
            page.mouse.up()
            # The step is sent when the drag ends: the kernel draws the pool as it was before step 1.
            page.wait_for_function("() => document.querySelector('.kvwb-page-map canvas').dataset.step === '0'",
                                   timeout=60_000)
            after = canvas.evaluate(CANVAS_STATS)
            assert after["hash"] != stats["hash"]
            assert after["colours"] <= 2                        # before the first step: free pages and gaps
            assert close(canvas.evaluate(CANVAS_RGB, known[-1]["xy"]), known[0]["rgb"])   # shared then, free now
            page.screenshot(path=str(ARTIFACTS / "browser_dashboard_scrubbed.png"), full_page=True)
            assert not errors, errors

            # The static export, offline: same colours on its own canvas, plotly inlined.
            static = browser.new_page(viewport={"width": 1400, "height": 1300}, device_scale_factor=1)
            static.route("**/*", lambda r: r.abort() if not r.request.url.startswith("file:") else r.continue_())
            static.goto((root / "incident.html").as_uri())
            static.wait_for_function(f"document.querySelector('canvas.kvwb-page-map').dataset.step == '{info['step']}'",
                                     timeout=30_000)
            check_known_pages(static, static.locator("canvas.kvwb-page-map"), known, "static export")
            assert static.locator("#kvwb-timelines svg.main-svg").count() >= 1
            static.screenshot(path=str(ARTIFACTS / "static_export.png"), full_page=True)
        except Exception:
            for i, pg in enumerate(p for c in browser.contexts for p in c.pages):
                try:
                    pg.screenshot(path=str(ARTIFACTS / f"browser_dashboard_failed_{i}.png"), full_page=True)
                except Exception:
                    pass
            raise
        finally:
            browser.close()
