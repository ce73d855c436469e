"""VllmConnection on bad input: nothing raises into the caller, every view keeps its last good state.

Real endpoints, no vLLM: a /metrics server over HTTP on 127.0.0.1 (that the test stops), a
KV-event address nothing publishes to, and a real ZMQ PUB sending malformed sanitizer messages."""
from __future__ import annotations

import contextlib
import json
import threading
import time

import numpy as np
import pytest
import zmq

from workbench.adapters.vllm.connection import VllmConnection
from workbench.adapters.vllm.listener import SanitizerListener

from vllm_fakes import MetricsServer, free_addr, free_port, wait_until

pytestmark = pytest.mark.timeout(60)

MODEL = 'model_name="HuggingFaceTB/SmolLM2-135M-Instruct"'
VLLM_TEXT = f'''# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{MODEL}}} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{MODEL}}} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{MODEL}}} 0.375
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",{MODEL}}} 3.0
vllm:num_preemptions_created{{engine="0",{MODEL}}} 1.7512345678901e+09
'''



def our_threads():
    return {t.name for t in threading.enumerate() if t.name in ("vllm-metrics", "vllm-kv-events",
                                                                  "kvwb-vllm-sanitizer", "kvwb-vllm-dashboard")}


# ---- /metrics -----------------------------------------------------------------------------
def test_wrong_url_is_a_sentence_naming_it():
    url = f"http://127.0.0.1:{free_port()}"          # nothing listens there
    with VllmConnection(url, interval_s=0.05) as conn:
        assert wait_until(lambda: conn.problems())
        probs = conn.problems()
        assert probs == [f"/metrics: cannot reach {url}/metrics: Connection refused"], probs
        line = conn.summary_line()
        assert line.startswith(f"vLLM {url}: usage - | running - waiting - | preemptions - ")
        assert conn.metrics_frame().empty and conn.findings == [] and conn.pool is None and conn.usage() is None


def test_dropped_connection_keeps_the_rows_and_says_so():
    server = MetricsServer(VLLM_TEXT)
    try:
        conn = VllmConnection(server.url, interval_s=0.05)
        assert wait_until(lambda: len(conn.metrics.rows) >= 3)
        assert conn.problems() == []
    finally:
        server.stop()
    try:
        assert wait_until(lambda: conn.problems())
        rows = conn.metrics.rows
        assert len(rows) >= 3 and rows[-1]["running"] == 4.0 and rows[-1]["kv_cache_usage"] == 0.375
        assert wait_until(lambda: conn.metrics.failures >= 3)
        assert len(conn.metrics.rows) == len(rows)        # no row made up while the server is gone
        probs = conn.problems()
        assert probs and all(p.startswith("/metrics: ") and server.url in p for p in probs), probs
        assert probs[-1] == f"/metrics: cannot reach {server.url}/metrics: Connection refused"
        line = conn.summary_line()                        # the view still shows the last good scrape
        assert "usage 37.5%" in line and "running 4 waiting 2" in line and "preemptions 3" in line
        assert len(conn.metrics_frame()) == len(rows)
    finally:
        conn.close()


# ---- KV events ----------------------------------------------------------------------------
def test_vllm_without_kv_events_points_at_kv_events_config():
    addr = free_addr()
    with VllmConnection(None, kv_events=addr) as conn:
        time.sleep(0.3)
        assert conn.problems() == []                      # not yet: vLLM may still be starting
        conn.started -= 30                                # as if it had been 30 s
        probs = conn.problems()
        assert len(probs) == 1 and probs[0].startswith("KV events: nothing received yet")
        assert "--kv-events-config" in probs[0] and "enable_kv_cache_events" in probs[0]
        assert "KV-event blocks 0" in conn.summary_line()


def test_sanitizer_silence_names_the_variable_to_set():
    addr = free_addr()
    with VllmConnection(None, sanitizer=addr) as conn:
        conn.started -= 30
        (p,) = conn.problems()
        assert p.startswith(f"sanitizer: nothing received on {addr}") and f"PAGEDKV_VLLM_SANITIZER={addr}" in p


# ---- the sanitizer stream -----------------------------------------------------------------
N = 8


def step_frames(step: int, n: int = N, ref_len: int | None = None, arrays: int = 3) -> list[bytes]:
    ref = np.zeros(n if ref_len is None else ref_len, np.int32)
    ref[1:3] = 1
    owner = np.full(n, -1, np.int32)
    owner[1:3] = 0
    cached = np.zeros(n, np.uint8)
    header = {"step": step, "t": time.time(), "step_s": 0.01, "check_s": 0.0, "num_blocks": n, "block_size": 16,
              "num_free": n - 3, "running": 1, "waiting": 0, "names": {"0": "cmpl-good"}}
    return [b"step", json.dumps(header).encode(), *[a.tobytes() for a in (ref, owner, cached)][:arrays]]


@contextlib.contextmanager
def publishing(on_step=None):
    """(connection, a plugin-like ZMQ PUB connected to it, its listener), past the slow joiner: a hello is
    sent until the listener has heard one (hellos touch neither the steps nor the pool)."""
    addr = free_addr()
    conn = VllmConnection(None, sanitizer=addr)
    if on_step is not None:
        from workbench.events import VllmStepChecked
        conn.bus.subscribe(VllmStepChecked, on_step)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    pub.connect(addr)
    lst = conn.sanitizer
    try:
        hello = [b"hello", json.dumps({"pid": 1, "process": "EngineCore_DP0", "vllm_version": "0.32"}).encode()]
        assert wait_until(lambda: (pub.send_multipart(hello), lst.messages)[1], timeout=5)
        yield conn, pub, lst
    finally:
        pub.close(0)
        ctx.term()
        conn.close()


def test_settle_waits_for_a_quiet_stream_from_the_call_and_no_longer_than_its_cap():
    # what the test driver calls after a vLLM run has exited, instead of a fixed sleep
    with publishing() as (conn, pub, lst):
        hello = [b"hello", json.dumps({"pid": 2, "process": "EngineCore_DP0", "vllm_version": "0.32"}).encode()]
        time.sleep(0.3)                     # the last message read long ago: still a quiet window from the call
        t0 = time.monotonic()
        lst.settle(0.1)
        assert 0.1 <= time.monotonic() - t0 < 0.5
        stop = threading.Event()

        def chatter():                      # a stream still arriving: settle waits it out
            while not stop.wait(0.03):
                pub.send_multipart(hello)
        sender = threading.Thread(target=chatter)
        sender.start()
        try:
            n0, t0 = lst.messages, time.monotonic()
            lst.settle(0.1, max_s=0.6)      # never quiet while it sends: the cap ends it
            took = time.monotonic() - t0
        finally:
            stop.set()
            sender.join()
        assert 0.55 <= took < 1.0 and lst.messages > n0 + 5, (took, lst.messages - n0)


def test_malformed_sanitizer_messages_are_named_and_the_last_good_pool_stays():
    with publishing() as (conn, pub, lst):
        # one good snapshot first
        pub.send_multipart(step_frames(1))
        assert wait_until(lambda: conn.pool is not None)
        good = conn.pool
        assert good is not None and good.step == 1 and good.ref.tolist() == [0, 1, 1, 0, 0, 0, 0, 0]
        assert lst.names == {0: "cmpl-good"}
        n_steps, n_errors = len(lst.steps), len(lst.errors)
        bad = [
            ([b"bogus", b"{}"], "unknown kind b'bogus'"),
            ([b"step", b"{not json"], "step header is not JSON"),
            ([b"finding", b"[1, 2]"], "finding header is a list, not an object"),
            (step_frames(2, ref_len=N - 1), f"sanitizer step 2: array 'ref' has {N - 1} entries, num_blocks says {N}"),
            (step_frames(3, arrays=2), "sanitizer step 3: 2 arrays, want 0 or 3"),
            ([b"finding", json.dumps({"probe": "vllm_pool", "kind": "leak", "severity": "fatal",
                                      "message": "m"}).encode()], "sanitizer finding with severity 'fatal'"),
            ([b"hello"], "sanitizer message of 1 frames"),
        ]
        for frames, _ in bad:
            pub.send_multipart(frames)
        assert wait_until(lambda: len(lst.errors) >= n_errors + len(bad)), lst.errors
        errors = lst.errors[n_errors:]
        for (_, words), err in zip(bad, errors):
            assert words in err, (words, err)
        # the last good state stays: no step recorded, the same pool, no finding made up
        assert len(lst.steps) == n_steps and conn.pool is good and conn.pool.step == 1
        assert conn.findings == []
        assert conn.usage() == pytest.approx(1 - (N - 3) / (N - 1))
        probs = conn.problems()
        assert len(probs) == 3 and all(p.startswith("sanitizer: ") for p in probs)     # the last three, named
        assert "severity 'fatal'" in probs[-2]
        assert "step -" not in conn.summary_line() and f"free {N - 3}/{N}" in conn.summary_line()
        # and the listener carries on: the next good message is applied
        pub.send_multipart(step_frames(4))
        assert wait_until(lambda: conn.pool.step == 4)


def test_a_sanitizer_address_off_loopback_is_refused_at_connect_time():
    for addr in ("tcp://10.1.2.3:5590", "tcp://0.0.0.0:5590", "tcp://*:5590"):
        with pytest.raises(ValueError) as e:
            VllmConnection(None, sanitizer=addr)
        assert addr in str(e.value) and "127.0.0.1" in str(e.value)
    with pytest.raises(ValueError, match="tcp://127.0.0.1:PORT"):
        VllmConnection(None, sanitizer="127.0.0.1:5590")
    from workbench import Workbench
    with pytest.raises(ValueError, match="10.9.8.7"):
        Workbench.connect_vllm(url=None, kv_events=None, sanitizer="tcp://10.9.8.7:5590")


def test_a_failed_connect_leaves_nothing_bound():
    addr = free_addr()
    before = our_threads()
    with pytest.raises(ValueError, match="10.0.0.9"):
        VllmConnection(f"http://127.0.0.1:{free_port()}", sanitizer=addr, kv_events="tcp://10.0.0.9:5557")
    assert wait_until(lambda: our_threads() <= before)
    # the sanitizer address was released (ZMQ unbinds in its I/O thread, a moment after close())
    assert wait_until(lambda: rebinds(addr), timeout=3)


def rebinds(addr: str) -> bool:
    try:
        SanitizerListener(addr).close()
    except ValueError:
        return False
    return True


# ---- the dashboard ------------------------------------------------------------------------
def test_dashboard_builds_without_a_server_and_closes_cleanly():
    pytest.importorskip("ipywidgets")
    from workbench import Workbench
    before = our_threads()
    url = f"http://127.0.0.1:{free_port()}"
    wb = Workbench.connect_vllm(url=url, kv_events=free_addr(), sanitizer=free_addr(), interval_s=0.05)
    dash = wb.dashboard(interval_s=0.05)
    try:
        assert "usage - | running - waiting - | preemptions - | step - free -/-" in dash.summary.value
        assert dash.page_map is None and "waiting for the first pool snapshot" in dash.map_box.children[0].value
        assert wait_until(lambda: "cannot reach" in dash.problems.value)
        assert url in dash.problems.value
        dash.refresh()
        assert len(dash.fig.data[0].x) == 0 and len(dash.findings.frame) == 0
        assert wb.findings.empty
    finally:
        dash.close()
        wb.close()
    assert wait_until(lambda: our_threads() <= before), our_threads()


def test_a_step_row_without_timings_reaches_the_timelines():
    # the idle sweep's row has no step time; a row may carry no check time either: the step still
    # becomes a VllmStepChecked (times None), nothing raises in the listener's thread
    got = []
    with publishing(on_step=got.append) as (conn, pub, lst):
        frames = step_frames(7)
        header = json.loads(frames[1])
        header.update(step_s=None, check_s=None)
        pub.send_multipart([b"step", json.dumps(header).encode(), *frames[2:]])
        pub.send_multipart(step_frames(8))
        assert wait_until(lambda: len(got) >= 2), lst.errors
        assert [(e.step, e.step_ns, e.check_ns) for e in got[:2]] == [(7, None, None), (8, 10_000_000, 0)]
        assert lst.errors == []
