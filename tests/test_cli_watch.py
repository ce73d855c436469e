"""`kvwb watch` on real local endpoints: a /metrics server over HTTP, the plugin's stream over ZMQ.

No vLLM: a ThreadingHTTPServer on 127.0.0.1 serves vLLM-format /metrics text, and a
stream.Publisher (the plugin's own sending end) sends step snapshots and findings to the
address `watch` binds. Once in-process (watch()), once as `kvwb watch` in a subprocess."""
from __future__ import annotations

import io
import queue
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from workbench import cli
from workbench.adapters.vllm import sanitizer
from workbench.adapters.vllm.stream import Publisher
from workbench.adapters.vllm.watch import finding_line, open_connection, watch

from vllm_fakes import MetricsServer, free_addr, free_port, wait_until

pytestmark = pytest.mark.timeout(60)

MODEL = 'model_name="HuggingFaceTB/SmolLM2-135M-Instruct"'
# vLLM 0.32's exposition, trimmed: two engines, HELP/TYPE lines, counters as _total + _created
VLLM_TEXT = f'''# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{MODEL}}} 3.0
vllm:num_requests_running{{engine="1",{MODEL}}} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{MODEL}}} 1.0
vllm:num_requests_waiting{{engine="1",{MODEL}}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{MODEL}}} 0.25
vllm:kv_cache_usage_perc{{engine="1",{MODEL}}} 0.75
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",{MODEL}}} 7.0
vllm:num_preemptions_total{{engine="1",{MODEL}}} 1.0
vllm:num_preemptions_created{{engine="0",{MODEL}}} 1.7512345678901e+09
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",{MODEL}}} 4096.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",{MODEL}}} 2048.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.005",{MODEL}}} 2.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",{MODEL}}} 9.0
vllm:time_to_first_token_seconds_count{{engine="0",{MODEL}}} 9.0
vllm:time_to_first_token_seconds_sum{{engine="0",{MODEL}}} 0.123
'''
USAGE = "usage 50.0%"          # the two engines' gauges (0.25, 0.75), averaged

ERROR_MSG = "step 3: block_table_tensor row 0 column 1 holds 9, request cmpl-A means 4"
WARN_MSG = "step 4: the KV event map is 2 blocks behind the pool"


@pytest.fixture
def server():
    s = MetricsServer(VLLM_TEXT)
    yield s
    s.stop()



# ---- what the plugin sends ----------------------------------------------------------------
NUM_BLOCKS = 16


def send_step(pub: Publisher, step: int) -> None:
    """A pool snapshot as hooks.after_step sends it: block 0 the null block, 1..4 owned by cmpl-A."""
    ref = np.zeros(NUM_BLOCKS, np.int32)
    ref[1:5] = 1
    owner = np.full(NUM_BLOCKS, -1, np.int32)
    owner[1:5] = 0
    cached = np.zeros(NUM_BLOCKS, np.uint8)
    cached[5] = 1
    pub.send(b"step", {"step": step, "t": time.time(), "step_s": 0.01, "check_s": 0.001, "num_blocks": NUM_BLOCKS,
                       "block_size": 16, "num_free": NUM_BLOCKS - 5, "running": 1, "waiting": 0, "hashed": 1,
                       "process": "EngineCore_DP0", "names": {"0": "cmpl-A"}}, (ref, owner, cached))


def error_finding() -> dict:
    return sanitizer.finding(sanitizer.PROBE_METADATA, "block-table", "error", ERROR_MSG, 3, "cmpl-A", 9,
                             copy="block_table_tensor", row=0, index=1, got=9, want=4, requests=["cmpl-A"])


def warn_finding() -> dict:
    return sanitizer.finding(sanitizer.PROBE_POOL, "counts", "warn", WARN_MSG, 4, None, None)


def joined_publisher(conn, step: int = 1) -> Publisher:
    """A PUB connected to conn's sanitizer address, past ZMQ's slow-joiner window."""
    pub = Publisher(conn.sanitizer.address)
    assert wait_until(lambda: (send_step(pub, step), conn.sanitizer.steps)[1], timeout=5), "no step arrived"
    return pub


def run_watch(conn, send, duration=1.5, interval=0.2, report=None, out=None):
    """watch() on this thread while `send` runs on another (after watch has started)."""
    out = io.StringIO() if out is None else out
    t = threading.Thread(target=send, daemon=True)
    t.start()
    rc = watch(conn, out, interval_s=interval, duration_s=duration, report=report)
    t.join(timeout=5)
    return rc, out.getvalue()


# ---- in-process ---------------------------------------------------------------------------
def test_watch_on_the_main_thread_ends_on_ctrl_c_and_gives_the_callers_handler_back(server, tmp_path):
    import os
    import signal
    def callers(signum, frame):                                 # the caller's own handler
        pass
    before = signal.signal(signal.SIGINT, callers)
    report = tmp_path / "sigint.html"
    conn = open_connection(server.url, interval_s=0.1)
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        rc = watch(conn, io.StringIO(), interval_s=0.2, duration_s=20, report=report)
        took = time.monotonic() - t0
        after = signal.getsignal(signal.SIGINT)
    finally:
        conn.close()
        signal.signal(signal.SIGINT, before)
    assert took < 10 and rc == 0 and report.exists(), took     # ended by the Ctrl-C, not the duration
    assert after is callers, after


def test_watch_prints_usage_and_the_finding_as_it_arrives_then_reports(server, tmp_path):
    report = tmp_path / "watch.html"
    conn = open_connection(server.url, sanitizer=free_addr(), interval_s=0.1)
    try:
        pub = joined_publisher(conn)

        def send():
            time.sleep(0.4)
            send_step(pub, 2)
            pub.send(b"finding", error_finding())
        rc, text = run_watch(conn, send, report=report)
        pub.close()
    finally:
        conn.close()
    lines = text.splitlines()
    summaries = [i for i, ln in enumerate(lines) if ln.startswith(f"vLLM {server.url}: ")]
    assert len(summaries) >= 5, text                      # one line per interval (not a TTY)
    assert USAGE in lines[summaries[-1]] and "running 5 waiting 1" in lines[summaries[-1]]
    assert "preemptions 8" in lines[summaries[-1]] and f"free {NUM_BLOCKS - 5}/{NUM_BLOCKS}" in lines[summaries[-1]]
    assert "findings 1 (1 >= error)" in lines[summaries[-1]]
    want = f"[error] vllm_metadata block-table request cmpl-A block 9: {ERROR_MSG}"
    found = [i for i, ln in enumerate(lines) if ln == want]
    assert len(found) == 1, text                           # printed once, not once per interval
    assert found[0] < summaries[-2], "the finding was printed only at the end, not as it arrived"
    assert "problem:" not in text, text
    assert rc == 1
    assert lines[-1] == f"report: {report}"
    page = report.read_text(encoding="utf-8")
    assert ERROR_MSG in page and "cmpl-A" in page and "block-table" in page
    assert "<svg" in page and "KV-cache usage" in page and USAGE in page
    assert "<script" not in page and "cdn" not in page.lower() and "src=" not in page     # self-contained


def test_watch_exits_0_without_error_findings_and_prints_each_problem_once(server, tmp_path):
    report = tmp_path / "warn.html"
    conn = open_connection(server.url, kv_events=free_addr(), sanitizer=free_addr(), interval_s=0.1)
    try:
        pub = joined_publisher(conn)
        conn.started -= 60                                 # nothing on the KV address "for a minute"

        def send():
            time.sleep(0.3)
            pub.send(b"finding", warn_finding())
        rc, text = run_watch(conn, send, duration=1.2, report=report)
        pub.close()
    finally:
        conn.close()
    assert rc == 0, text
    assert text.count(f"[warn] vllm_pool counts request - block -: {WARN_MSG}") == 1, text
    kv_problems = [ln for ln in text.splitlines() if ln.startswith("problem: KV events:")]
    assert len(kv_problems) == 1 and "--kv-events-config" in kv_problems[0], text
    assert "findings 1 (0 >= error)" in text.splitlines()[-2]
    page = report.read_text(encoding="utf-8")
    assert WARN_MSG in page and "--kv-events-config" in page


def test_watch_on_a_tty_rewrites_the_summary_in_place(server):
    class Tty(io.StringIO):
        def isatty(self):
            return True
    conn = open_connection(server.url, sanitizer=free_addr(), interval_s=0.1)
    try:
        pub = joined_publisher(conn)

        def send():
            time.sleep(0.3)
            pub.send(b"finding", error_finding())
        rc, text = run_watch(conn, send, duration=1.0, interval=0.2, out=Tty())
        pub.close()
    finally:
        conn.close()
    assert rc == 1
    assert text.count("\r") >= 5 and "\x1b[K" in text
    # the finding clears the status line, takes a line of its own, and the status comes back under it
    assert f"\r\x1b[K[error] vllm_metadata block-table request cmpl-A block 9: {ERROR_MSG}\nvLLM " in text
    assert text.endswith("\n") and USAGE in text.rsplit("\r", 1)[-1]
    # summary lines never end a line of their own before the last one: they are rewritten
    assert sum(ln.startswith("vLLM ") for ln in text.split("\n")) <= 2


def test_finding_line_names_every_field():
    from workbench.findings import Finding
    f = Finding(probe="vllm_pool", severity="error", message="step 9: request r7 is no longer\nscheduled",
                kind="orphan", request_id="r7", page=12)
    assert finding_line(f) == "[error] vllm_pool orphan request r7 block 12: step 9: request r7 is no longer scheduled"


# ---- the command line ---------------------------------------------------------------------
def test_bad_addresses_give_one_line_and_exit_2(capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    cases = [(["--sanitizer", "tcp://10.1.2.3:5590"], "10.1.2.3"),
             (["--kv-events", "tcp://192.168.0.7:5557"], "192.168.0.7"),
             (["--sanitizer", f"tcp://127.0.0.1:{port}"], "cannot bind"),
             (["--kv-events", f"tcp://127.0.0.1:{port}"], "cannot bind"),
             (["--sanitizer", "udp://127.0.0.1:5590"], "tcp://127.0.0.1:PORT"),
             (["--kv-replay", free_addr()], "--kv-events")]
    try:
        for extra, words in cases:
            rc = cli.main(["watch", "--vllm", f"http://127.0.0.1:{free_port()}", *extra, "--duration", "0"])
            err = capsys.readouterr().err
            assert rc == 2, (extra, err)
            assert err.count("\n") == 1 and err.startswith("kvwb watch: ") and words in err, (extra, err)
        for url in ("localhost:8000", "ftp://127.0.0.1/x", "http://127.0.0.1:99999"):
            assert cli.main(["watch", "--vllm", url]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and url in err, err
    finally:
        taken.close()


def kvwb(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "workbench.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_kvwb_watch_subprocess(server, tmp_path):
    report = tmp_path / "cli.html"
    addr = free_addr()
    p = kvwb("watch", "--vllm", server.url, "--sanitizer", addr, "--interval", "0.2", "--duration", "4",
             "--report", report)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(ln) for ln in p.stdout], daemon=True)
    reader.start()
    pub = Publisher(addr)                      # connects whenever the subprocess has bound it
    seen = []
    try:
        deadline = time.monotonic() + 15
        step = 0
        while not any(" step " in ln and " step - " not in ln for ln in seen):
            assert time.monotonic() < deadline and p.poll() is None, (seen, p.poll())
            step += 1
            send_step(pub, step)
            try:
                seen.append(lines.get(timeout=0.1))
            except queue.Empty:
                pass
        pub.send(b"finding", error_finding())
        rc = p.wait(timeout=20)
    finally:
        pub.close()
        if p.poll() is None:
            p.kill()
            p.wait()
    reader.join(timeout=5)
    while not lines.empty():
        seen.append(lines.get())
    out, err = "".join(seen), p.stderr.read()
    assert rc == 1, (out, err)
    assert "Traceback" not in err and err == "", err
    assert f"[error] vllm_metadata block-table request cmpl-A block 9: {ERROR_MSG}" in out
    assert USAGE in out and f"report: {report}" in out
    assert ERROR_MSG in report.read_text(encoding="utf-8")


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_kvwb_watch_stops_on_ctrl_c_and_still_reports(server, tmp_path, inherited):
    # "ignored": started with SIGINT ignored (nohup-like launchers, some CI runners), a process keeps it
    # ignored, since Python installs its KeyboardInterrupt handler only over the default; the watch takes
    # Ctrl-C itself
    import signal
    report = tmp_path / "int.html"
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if inherited == "ignored" else None
    p = kvwb("watch", "--vllm", server.url, "--interval", "0.2", "--report", report, preexec_fn=ignore)
    try:
        first = p.stdout.readline()                 # watching: the first summary line is out
        assert first.startswith(f"vLLM {server.url}: "), (first, p.stderr.read() if p.poll() is not None else "")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=15)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0 and "Traceback" not in err, err
    assert out.rstrip().endswith(f"report: {report}") and report.exists()


def test_kvwb_watch_subprocess_bad_address_no_traceback():
    p = kvwb("watch", "--vllm", "http://127.0.0.1:8000", "--sanitizer", "tcp://0.0.0.0:5590")
    out, err = p.communicate(timeout=30)
    assert p.returncode == 2 and out == ""
    assert err.count("\n") == 1 and "0.0.0.0" in err and "Traceback" not in err, err
