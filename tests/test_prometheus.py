"""The Prometheus endpoint: a real engine served on 127.0.0.1, scraped over HTTP, parsed with
prometheus_client's own parser, and held against engine.stats() at the same moment."""
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import zipfile
from collections import Counter

import numpy as np
import psutil
import pytest
import yaml
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from workbench import Engine, EngineConfig, Probe, SamplingParams, Workbench
from workbench.export import METRIC_NAMES, alerts_path, serve_metrics
from workbench.findings import SEVERITIES

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
COUNTERS = ("kvwb_num_preemptions_total", "kvwb_prefix_cache_queries_total", "kvwb_prefix_cache_hits_total",
            "kvwb_page_evictions_total", "kvwb_steps_total")


def prompts(n, seed=0, lo=3, hi=90):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def scrape(url) -> dict:
    """{(sample name, ((label, value), ...)): value} from one HTTP scrape."""
    with urllib.request.urlopen(url, timeout=120) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def from_stats(st: dict) -> dict:
    """What the endpoint must say, by contract name, given engine.stats()."""
    return {
        "kvwb_kv_cache_usage_ratio": st["pages_used"] / st["pages_total"],
        "kvwb_pages_used": st["pages_used"], "kvwb_pages_total": st["pages_total"],
        "kvwb_pages_cached": st["pages_cached"], "kvwb_pages_free": st["pages_free"],
        "kvwb_num_running": st["num_running"], "kvwb_num_waiting": st["num_waiting"],
        "kvwb_num_preemptions_total": st["num_preemptions"],
        "kvwb_prefix_cache_queries_total": st["prefix_cache_queries"],
        "kvwb_prefix_cache_hits_total": st["prefix_cache_hits"],
        "kvwb_page_evictions_total": st["num_evictions"], "kvwb_steps_total": st["steps"],
    }


def unlabelled(m: dict) -> dict:
    return {name: v for (name, labels), v in m.items() if not labels}


def findings(m: dict) -> dict:
    return {(dict(lb)["probe"], dict(lb)["severity"]): v for (name, lb), v in m.items()
            if name == "kvwb_findings_total"}


class NotesProbe(Probe):
    """A probe whose findings the test writes itself (the findings metric's source)."""
    name = "notes"


def test_scrape_equals_engine_stats(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=14))
    wb = Workbench(eng)
    notes = wb.probes["notes"] = NotesProbe().attach(eng)
    for i in range(2):
        notes.report("warn", f"pool nearly full ({i})", hint="raise num_pages", step=i)
    notes.report("error", "page 3 reused while mapped", hint="refcount shared pages", page=3)
    with serve_metrics(wb) as srv:
        for p in prompts(10):
            eng.add_request(p, GREEDY)
        seen = Counter()
        while eng.has_unfinished():
            eng.step()
            m, st = unlabelled(scrape(srv.url)), eng.stats()   # engine idle between steps: same moment
            for name, want in from_stats(st).items():
                assert m[name] == pytest.approx(want), name
            assert m["kvwb_kv_cache_usage_ratio"] == pytest.approx(st["kv_cache_usage"])
            assert m["kvwb_kv_cache_used_bytes"] == st["pages_used"] * eng.kv.bytes_per_page
            seen.update(running=st["num_running"] > 0, waiting=st["num_waiting"] > 0,
                        used=st["pages_used"] > 0)
        assert seen["running"] and seen["waiting"] and seen["used"]     # live values, not just zeros

        repeated = prompts(1, seed=7, lo=60, hi=61)[0]                 # 3 full pages, cached on finish
        eng.generate([repeated], GREEDY)
        hits = eng.stats()["prefix_cache_hits"]
        eng.generate([repeated], GREEDY)
        full = scrape(srv.url)
        st = eng.stats()
        assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] - hits >= 48
        for name, want in from_stats(st).items():
            assert unlabelled(full)[name] == pytest.approx(want), name
        assert unlabelled(full)["kvwb_page_size_tokens"] == 16
        assert unlabelled(full)["kvwb_kv_cache_bytes"] == eng.kv.total_bytes
        info = dict(next(lb for (n, lb) in full if n == "kvwb_engine_info"))
        assert info["model"] == str(eng.source) and info["prefix_caching"] == "true"

        # Findings: counted per (probe, severity) from the Workbench, zeros for the quiet severities.
        want = Counter((f.probe, f.severity) for f in wb.all_findings())
        assert want == {("notes", "warn"): 2, ("notes", "error"): 1}
        assert findings(full) == {("notes", s): want[("notes", s)] for s in SEVERITIES}
        notes.report("critical", "kernel read block-table version 4, current 5", hint="bind before launch")
        assert findings(scrape(srv.url))[("notes", "critical")] == 1          # read at scrape time


def listening_ports() -> dict:
    """{port: ip} of this process's listening TCP sockets, as the OS reports them."""
    return {c.laddr.port: c.laddr.ip for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def test_binds_loopback_private_registry_and_stop_frees_port(tiny_llama_dir):
    small = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=20))
    big = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64))
    srv = serve_metrics(small)                                  # defaults: port 0, 127.0.0.1
    port = srv.port
    assert port > 0 and srv.addr == "127.0.0.1"
    assert listening_ports()[port] == "127.0.0.1"
    with serve_metrics(big) as other:                           # two engines, two registries
        assert other.port != port
        assert unlabelled(scrape(srv.url))["kvwb_pages_total"] == 20
        assert unlabelled(scrape(other.url))["kvwb_pages_total"] == 64
    assert REGISTRY.get_sample_value("kvwb_pages_total") is None        # the global one is untouched

    srv.stop()
    srv.stop()                                                  # idempotent
    assert port not in listening_ports()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(srv.url, timeout=30)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # TIME_WAIT may linger; a listener may not
    s.bind(("127.0.0.1", port))
    s.listen()
    s.close()
    with serve_metrics(small, port=port) as again:              # the same port serves again
        assert again.port == port and unlabelled(scrape(again.url))["kvwb_pages_total"] == 20


def test_scrape_during_generation(tiny_llama_dir):
    ps = prompts(10, seed=1)
    ref = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=14))
    expect = [o.token_ids for o in ref.generate(ps, GREEDY)]

    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=14))
    wb = Workbench(eng)
    scraped, done = threading.Semaphore(0), threading.Event()
    outs, errors = {}, []

    def drive():                           # the engine thread; every 3rd step waits for a scrape,
        try:                               # so scrapes interleave with steps on any machine load
            rids = [eng.add_request(p, GREEDY) for p in ps]
            while eng.has_unfinished():
                for o in eng.step():
                    outs[o.request_id] = o
                if eng.step_count % 3 == 0:
                    scraped.acquire(timeout=120)
            outs["order"] = rids
        except BaseException as e:         # noqa: BLE001 - reported by the assert below
            errors.append(e)
        finally:
            done.set()

    with serve_metrics(wb) as srv:
        t = threading.Thread(target=drive)
        t.start()
        snaps = []
        while not done.is_set():
            snaps.append(unlabelled(scrape(srv.url)))
            scraped.release()
        t.join()
        snaps.append(unlabelled(scrape(srv.url)))
    assert not errors
    final = eng.stats()
    assert [outs[r].token_ids for r in outs["order"]] == expect          # scraping changed nothing
    assert len(snaps) >= final["steps"] // 3
    assert any(0 < s["kvwb_steps_total"] < final["steps"] for s in snaps)    # seen mid-run
    assert final["num_preemptions"] > 0
    for a, b in zip(snaps, snaps[1:]):
        for c in COUNTERS:
            assert b[c] >= a[c], c
    for s in snaps:                        # one stats() call per scrape: a consistent snapshot
        assert 0 <= s["kvwb_pages_used"] <= s["kvwb_pages_total"] == 14
        assert s["kvwb_pages_used"] + s["kvwb_pages_free"] == 14
        assert s["kvwb_kv_cache_usage_ratio"] == pytest.approx(s["kvwb_pages_used"] / 14)
    assert {k: snaps[-1][k] for k in from_stats(final)} == pytest.approx(from_stats(final))
    assert wb.findings.empty                                          # no probe-error either


def test_alert_rules_reference_served_metrics_and_fire(tiny_llama_dir):
    rules = [r for g in yaml.safe_load(alerts_path().read_text())["groups"] for r in g["rules"]]
    by_name = {r["alert"]: r for r in rules}
    assert len(by_name) == len(rules) >= 3
    for r in rules:
        assert isinstance(r["expr"], str) and r["labels"]["severity"] in ("warning", "critical")
        assert re.fullmatch(r"\d+[smh]", r.get("for", "0s"))
    usage = by_name["KVCacheNearlyFull"]
    assert usage["for"] == "1m"
    metric, threshold = re.fullmatch(r"(kvwb_\w+) > ([\d.]+)", usage["expr"]).groups()
    assert metric == "kvwb_kv_cache_usage_ratio" and float(threshold) == 0.95
    assert any("kvwb_num_preemptions_total" in r["expr"] and "rate(" in r["expr"] for r in rules)
    assert any("kvwb_findings_total" in r["expr"] and "error" in r["expr"] for r in rules)

    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=14))
    wb = Workbench(eng)
    wb.probes["notes"] = NotesProbe().attach(eng)
    with serve_metrics(wb) as srv:
        served = {name for name, _ in scrape(srv.url)}
        for r in rules:                    # every metric an alert names is one the endpoint serves
            names = set(re.findall(r"kvwb_\w+", r["expr"]))
            assert names and names <= served <= METRIC_NAMES, r["alert"]
        # The usage alert's condition holds on a pool driven full, and not on the idle one.
        for p in prompts(10, seed=2):
            eng.add_request(p, GREEDY)
        fired = []
        while eng.has_unfinished():
            eng.step()
            fired.append(unlabelled(scrape(srv.url))[metric] > float(threshold))
        assert any(fired)
        assert not unlabelled(scrape(srv.url))[metric] > float(threshold)


def test_alerts_ship_in_the_wheel(tmp_path):
    root = alerts_path().parents[2]
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("workbench", "probes"):
        shutil.copytree(root / d, src / d, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(root / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "workbench/export/alerts.yml" in names
    data = yaml.safe_load(zipfile.ZipFile(wheel).read("workbench/export/alerts.yml"))
    assert data == yaml.safe_load(alerts_path().read_text())


def test_cli_serve_metrics(tiny_llama_dir):
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "serve-metrics", "--model",
                             str(tiny_llama_dir), "--port", "0", "--num-pages", "24"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stdout:           # the first line naming the URL (after any load chatter)
            url = re.search(r"http://127\.0\.0\.1:\d+/metrics", line)
            if url:
                break
        assert url, (proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
        m = unlabelled(scrape(url.group(0)))
        assert m["kvwb_pages_total"] == 24 and m["kvwb_steps_total"] == 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
