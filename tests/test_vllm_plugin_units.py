"""The plugin's parts on their own, no vLLM: settings, fault files, the ledger, the family wrap,
the listener's check-inactive judgement, `kvwb vllm status`, and the kvwb_vllm_check_active
gauge over a real HTTP scrape. The same parts inside a real vLLM: test_vllm_step_paths.py."""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from types import SimpleNamespace as NS

import pytest

from workbench.adapters.vllm import settings
from workbench.adapters.vllm.faults import read_fault_file
import numpy as np

from workbench.adapters.vllm import sanitizer
from workbench.adapters.vllm.ledger import BlockLedger, GroupRule
from workbench.adapters.vllm.patching import wrap_family
from workbench.adapters.vllm.server import free_port, vllm_python


# ---- settings and fault files -------------------------------------------------------------
def test_settings_off_by_default_and_bad_values_fall_back_with_a_sentence():
    assert not settings.read({}).enabled
    s = settings.read({"PAGEDKV_VLLM_SANITIZER": "tcp://127.0.0.1:5590", "PAGEDKV_VLLM_POOL_EVERY": "often",
                       "PAGEDKV_VLLM_FULL_EVERY": "-1", "PAGEDKV_VLLM_INACTIVE_AFTER": " 12 "})
    assert s.enabled and s.address == "tcp://127.0.0.1:5590"
    assert (s.pool_every, s.full_every, s.sweep_slice, s.inactive_after) == (1, 0, 512, 12)
    assert s.problems == ["PAGEDKV_VLLM_POOL_EVERY='often' is not a whole number >= 1; using 1",
                          "PAGEDKV_VLLM_FULL_EVERY='-1' is not a whole number >= 0; using 0"]
    for bad in ("not-an-address", "tcp://127.0.0.1", "http://127.0.0.1:80", "tcp://:80", "ipc://"):
        s = settings.read({"PAGEDKV_VLLM_SANITIZER": bad})
        assert s.enabled and s.address is None and bad in s.problems[0], (bad, s.problems)
    assert settings.read({"PAGEDKV_VLLM_SANITIZER": "ipc:///tmp/kvwb.sock"}).address == "ipc:///tmp/kvwb.sock"
    on = "tcp://127.0.0.1:5590"
    assert settings.read({"PAGEDKV_VLLM_SANITIZER": on}).check_thread
    assert not settings.read({"PAGEDKV_VLLM_SANITIZER": on, "PAGEDKV_VLLM_CHECK_THREAD": "off"}).check_thread


def test_the_checks_thread_runs_jobs_in_order_and_drain_waits_for_every_one():
    """aside.py: jobs run off the caller's thread, in submission order; drain() returns only once all
    submitted so far are done (vLLM's next call reads a settled state); a job's exception is reported
    and the next job still runs; inline mode runs each job at once on the caller's thread."""
    from workbench.adapters.vllm.aside import Aside
    errors, done, where = [], [], []
    gate = threading.Event()
    a = Aside(lambda w, e: errors.append((w, str(e))))

    def job(i, wait_for=None):
        if wait_for is not None:
            assert wait_for.wait(5)
        where.append(threading.current_thread().name)
        done.append(i)

    def bad():
        raise ValueError("boom")
    a.submit("first", job, 0, gate)
    a.submit("bad", bad)
    a.submit("third", job, 2)
    assert done == [] and a._pending == 3             # the first job holds the thread: nothing ran yet
    t0 = time.perf_counter()
    threading.Timer(0.2, gate.set).start()
    a.drain()
    assert time.perf_counter() - t0 >= 0.15 and a.waited_s >= 0.15   # drain really waited
    assert done == [0, 2] and errors == [("bad", "boom")] and a._pending == 0
    assert set(where) == {"kvwb-plugin-checks"}
    t0 = time.perf_counter()
    a.drain()                                         # nothing pending: at once
    assert time.perf_counter() - t0 < 0.01
    inline = Aside(lambda w, e: errors.append((w, str(e))), threaded=False)
    inline.submit("inline", job, 3)
    assert done[-1] == 3 and where[-1] == threading.current_thread().name and inline._thread is None


@pytest.mark.parametrize("content, says", [('{"faults": null}', '"faults" must be a list of names'),
                                           ("{not json", "not JSON"), ("[1, 2]", 'want an object {"faults"'),
                                           ('{"faults": ["nope"]}', "unknown vLLM faults ['nope']"),
                                           ('{"faults": [3]}', '"faults" must be a list of names')])
def test_a_bad_fault_file_is_named_with_what_is_wrong(tmp_path, content, says):
    p = tmp_path / "f.json"
    p.write_text(content)
    with pytest.raises(ValueError) as e:
        read_fault_file(str(p))
    assert str(p) in str(e.value) and says in str(e.value)


# ---- the ledger ---------------------------------------------------------------------------
def out(new=(), cached=(), finished=(), preempted=(), sched=None):
    """A SchedulerOutput as vLLM 0.32 spells it (only the fields the ledger reads)."""
    c = NS(req_ids=[r for r, *_ in cached], resumed_req_ids={r for r, _, _, res in cached if res},
           new_block_ids=[b for _, b, _, _ in cached], num_computed_tokens=[n for _, _, n, _ in cached])
    return NS(scheduled_new_reqs=[NS(req_id=r, block_ids=b, num_computed_tokens=n) for r, b, n in new],
              scheduled_cached_reqs=c, finished_req_ids=set(finished), preempted_req_ids=set(preempted),
              num_scheduled_tokens=sched or {})


def test_ledger_follows_scheduler_outputs_and_counts_holders():
    led = BlockLedger(16)
    d = led.apply(out(new=[("a", ([1, 2],), 0), ("b", ([1, 3],), 32)], sched={"a": 40, "b": 8}))
    assert d.added == {1, 2, 3} and led.holders() == {"a": [1, 2], "b": [1, 3]}
    assert led.counts[1] == 2 and led.counts[2] == 1 and led.reqs["b"].computed == 32
    d = led.apply(out(cached=[("a", ([4],), 40, False), ("b", None, 40, False)], sched={"a": 1, "b": 1}))
    assert d.added == {4} and led.holders()["a"] == [1, 2, 4] and led.reqs["a"].scheduled == 1
    # preempted: let go; resumed later with a whole new list (it replaces, not appends)
    d = led.apply(out(preempted=["b"]))
    assert d.removed == {1, 3} and "b" not in led.reqs and led.counts[3] == 0 and led.counts[1] == 1
    led.apply(out(cached=[("b", ([5, 6],), 0, True)]))
    assert led.holders()["b"] == [5, 6]
    # finished: the last to let go of a block names it
    d = led.finish(["a"])
    assert d.released == {"a": [1, 2, 4]} and led.last_holder[2] == "a"
    assert led.counts.sum() == 2 and led.counts[5] == led.counts[6] == 1 and led.optional.sum() == 0


def test_a_sliding_window_groups_blocks_behind_the_window_may_go_and_the_edge_must_stay():
    # group 0: sliding window of 64 tokens, blocks of 32; group 1: full attention; null block 0
    led = BlockLedger(32, [GroupRule("sliding", 64), GroupRule()], [32, 32], null_block=0)
    s1 = out(new=[("a", ([1, 2, 3], [4, 5, 6]), 0)], sched={"a": 96})
    led.apply(s1)
    assert led.optional.sum() == 0 and led.counts[1:7].tolist() == [1] * 6
    # the next step is scheduled (34 more tokens) before the first one's results are back (a batch
    # queue): vLLM frees on the processed basis, so nothing may have gone yet
    s2 = out(cached=[("a", ([7], [8]), 96, False)], sched={"a": 34})
    led.apply(s2)
    assert led.optional.sum() == 0
    d = led.done(s1)            # 96 processed: tokens 0..32 behind the window -> block 1 may go
    assert led.optional[[1, 2]].tolist() == [1, 0] and d.edge == {2}
    d = led.done(s2)            # 130 processed: tokens 0..66 -> blocks 1, 2 (not 3: token 66 is in it)
    assert led.optional[[1, 2]].tolist() == [1, 1] and led.counts[[1, 2]].tolist() == [0, 0]
    assert led.counts[[3, 4, 7, 8]].tolist() == [1, 1, 1, 1] and d.edge == {3}
    assert led.holders(0) == {"a": [3, 7]} and led.holders(0, optional=True) == {"a": [1, 2]}
    # a prefix hit in a sliding group starts with the null block: never counted
    led.apply(out(new=[("b", ([0, 3], [4, 5]), 64)], sched={"b": 8}))
    assert led.counts[0] == 0 and led.counts[3] == 2
    led.finish(["a", "b"])
    assert led.counts.sum() == 0 and led.optional.sum() == 0
    # the pool's verdict from the two counts: ref 0 on a block still in the window is an error naming
    # the request; ref 0 behind the window is not; a reference nobody can hold is a leak
    s3 = out(new=[("c", ([9, 10, 11], [12, 13, 14]), 0)], sched={"c": 96})
    led.apply(s3)
    s4 = out(cached=[("c", None, 96, False)], sched={"c": 34})
    led.apply(s4)
    led.done(s3)
    led.done(s4)
    blocks = np.array([9, 10, 11, 12, 20])
    ref = np.array([0, 0, 0, 1, 1])
    found = sanitizer.touched_block_findings(5, blocks, ref, ref == 0, led.counts[blocks], led.last_holder,
                                             may=led.optional[blocks], who=led.who)
    kinds = sorted((f["kind"], f["page"], f["request_id"]) for f in found)
    assert kinds == [("leak", 20, None), ("refcount", 11, "c")], kinds
    (f,) = [f for f in found if f["kind"] == "refcount"]
    assert "freed while in use" in f["message"] and "c's block 2 of KV cache group 0" in f["message"]
    assert f["evidence"]["held_as"] == [{"request": "c", "kv_cache_group": 0, "index": 2}]


def test_a_group_the_ledger_does_not_model_is_not_counted():
    # a Mamba / state group: its blocks are pinned from vLLM's own lists instead (pool_sweep.PoolSweep._pins);
    # counting them here as well would expect two references where vLLM keeps one
    led = BlockLedger(16, [GroupRule(), GroupRule("unmodelled")], [16, 16])
    led.apply(out(new=[("a", ([1, 2], [9]), 0)], sched={"a": 20}))
    assert led.counts[[1, 2, 9]].tolist() == [1, 1, 0] and led.holders() == {"a": [1, 2]}
    led.finish(["a"])
    assert led.counts.sum() == 0


# ---- the family wrap ----------------------------------------------------------------------
def test_family_wrap_reaches_overrides_later_subclasses_and_knows_the_outer_call():
    calls = []

    class Base:
        def build(self, x):
            return ("base", x)

    class Over(Base):                       # overrides and calls super(): the hook runs once, outside
        def build(self, x):
            return ("over", super().build(x))

    def make(orig):
        def hook(self, x, outer):
            calls.append((type(self).__name__, orig.__qualname__, outer))
            return orig(self, x)
        return hook

    wrapped = wrap_family(Base, "build", make)
    assert len(wrapped) == 2

    class Later(Base):                      # defined after the wrap (a platform plugin imported late)
        def build(self, x):
            return ("later", x)

    class Plain(Base):                      # no override of its own: the base's wrap covers it
        pass

    assert Over().build(1) == ("over", ("base", 1))
    assert calls == [("Over", "test_family_wrap_reaches_overrides_later_subclasses_and_knows_the_outer_call."
                               "<locals>.Over.build", True),
                     ("Over", "test_family_wrap_reaches_overrides_later_subclasses_and_knows_the_outer_call."
                              "<locals>.Base.build", False)]
    calls.clear()
    assert Later().build(2) == ("later", 2) and Plain().build(3) == ("base", 3)
    assert [(c[0], c[2]) for c in calls] == [("Later", True), ("Plain", True)]
    wrap_family(Base, "build", make)        # installing twice wraps nothing twice
    calls.clear()
    Plain().build(4)
    assert len(calls) == 1


# ---- what the workbench makes of the plugin's messages ------------------------------------
class Plugin:
    """The plugin's sending end (stream.Publisher), as a vLLM process would use it."""

    def __init__(self, address):
        from workbench.adapters.vllm.stream import Publisher
        self.pub = Publisher(address)
        time.sleep(0.3)

    def status(self, check, active, path="", reason=""):
        self.pub.send(b"status", {"check": check, "active": active, "via": "hook", "path": path, "reason": reason})

    def step(self, i, running=1):
        self.pub.send(b"step", {"step": i, "t": time.time(), "step_s": 0.01, "check_s": 0.0, "num_blocks": 8,
                                "num_free": 7, "running": running, "waiting": 0, "full": False})


def wait(pred, timeout=5):
    t0 = time.time()
    while not pred() and time.time() - t0 < timeout:
        time.sleep(0.05)
    return pred()


def test_engine_steps_without_worker_checks_become_one_check_inactive_warning():
    from workbench.adapters.vllm.listener import SanitizerListener
    addr = f"tcp://127.0.0.1:{free_port()}"
    lis = SanitizerListener(addr, inactive_after=10)
    try:
        p = Plugin(addr)
        p.status("vllm_metadata", True, "V2 model runner")
        p.pub.send(b"cost", {"process": "w", "checks": 3, "check_s": 0.001, "executions": 3})
        for i in range(9):
            p.step(i)
        assert wait(lambda: len(lis.steps) == 9) and not lis.findings
        for i in range(9, 30):
            p.step(i, running=0 if i < 12 else 1)         # idle steps do not count
        assert wait(lambda: lis.findings)
        (f,) = lis.findings
        assert f.kind == "check-inactive" and f.severity == "warn" and f.probe == "vllm_metadata"
        assert "stopped advancing" in f.message and f.evidence["steps"] >= 10
    finally:
        lis.close()


def test_status_command_and_the_gauge_over_http(capsys):
    from workbench.adapters.vllm.connection import VllmConnection
    from workbench.cli import main
    addr = f"tcp://127.0.0.1:{free_port()}"
    stop = threading.Event()

    def plugin():                              # repeats its status, as the plugin's ticker does
        p = Plugin(addr)
        while not stop.is_set():
            p.status("vllm_pool", True, "EngineCore.step_with_batch_queue, batch queue size 2, AsyncScheduler")
            p.status("vllm_metadata", False, reason="group 0 (MambaSpec: not checked)")
            time.sleep(0.2)
    t = threading.Thread(target=plugin, daemon=True)
    t.start()
    try:
        rc = main(["vllm", "status", "--sanitizer", addr, "--wait", "5"])
        lines = capsys.readouterr().out.splitlines()
        assert rc == 1, lines                 # a check is not active: say so in the exit code
        assert "vllm_pool: active via hook (EngineCore.step_with_batch_queue, batch queue size 2, AsyncScheduler)" \
            in lines
        assert "vllm_metadata: NOT active; group 0 (MambaSpec: not checked)" in lines
        conn = VllmConnection(url=None, sanitizer=addr)
        try:
            assert wait(lambda: len(conn.checks()) == 2)
            assert "vllm_metadata is NOT active" in " ".join(conn.problems())
            assert "vllm_pool on (EngineCore.step_with_batch_queue" in conn.checks_line()
            with conn.serve_metrics() as server:
                text = urllib.request.urlopen(server.url, timeout=5).read().decode()
            assert 'kvwb_vllm_check_active{check="vllm_pool"} 1.0' in text
            assert 'kvwb_vllm_check_active{check="vllm_metadata"} 0.0' in text
            assert 'kvwb_findings_total{probe="vllm_pool",severity="error"} 0.0' in text
        finally:
            conn.close()
    finally:
        stop.set()
        t.join(2)


def test_status_command_says_when_nothing_is_heard(capsys):
    from workbench.cli import main
    assert main(["vllm", "status", "--sanitizer", f"tcp://127.0.0.1:{free_port()}", "--wait", "0.2"]) == 3
    assert "nothing heard" in capsys.readouterr().err
    assert main(["vllm", "status", "--sanitizer", "tcp://10.0.0.1:5590", "--wait", "0.2"]) == 2
    assert "binds only 127.0.0.1" in capsys.readouterr().err


SEAMS_PROBE = r'''
import json, sys
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
own = kv_cache_utils.hash_block_tokens
from workbench.adapters.vllm import hooks, settings
hooks.install(settings.read())
mark = "__pagedkv_wrapped__"
fns = {"_free_request_blocks": Scheduler._free_request_blocks, "allocate_slots": KVCacheManager.allocate_slots,
       "touch": BlockPool.touch}
print("RESULT " + json.dumps({
    "hash_is_vllms": kv_cache_utils.hash_block_tokens is own,
    "hash_reaches_vllms": getattr(kv_cache_utils.hash_block_tokens, "__wrapped__", None) is own,
    "hash_name": kv_cache_utils.hash_block_tokens.__name__,
    "wrapped": sorted(k for k, f in fns.items() if getattr(f, mark, False)),
    "checks_wrapped": bool(getattr(Scheduler.schedule, mark, False)),
    "schedule_reaches_vllms": hasattr(Scheduler.schedule, "__wrapped__")}))
'''


@pytest.mark.skipif(not vllm_python().exists(), reason=f"no vLLM environment at {vllm_python()}")
@pytest.mark.parametrize("with_fault_file", [False, True])
def test_fault_seams_are_installed_only_with_a_fault_file(tmp_path, with_fault_file):
    import json
    from workbench.adapters.vllm.driver import run_python
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_VLLM_")}
    env["PAGEDKV_VLLM_SANITIZER"] = "tcp://127.0.0.1:5599"
    if with_fault_file:
        (tmp_path / "f.json").write_text('{"faults": []}')
        env["PAGEDKV_VLLM_FAULT_FILE"] = str(tmp_path / "f.json")
    p = run_python(SEAMS_PROBE, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, p.stdout[-2000:] + p.stderr[-3000:]
    r = json.loads(lines[-1][7:])
    assert r["checks_wrapped"] and r["schedule_reaches_vllms"]          # the checks' hooks: functools.wraps
    if with_fault_file:
        assert not r["hash_is_vllms"] and r["hash_reaches_vllms"] and r["hash_name"] == "hash_block_tokens"
        assert r["wrapped"] == ["_free_request_blocks", "allocate_slots", "touch"]
    else:
        assert r["hash_is_vllms"] and r["wrapped"] == []                   # vLLM's own functions, untouched


def test_a_rotating_slice_patches_the_page_map_snapshot_and_a_bad_slice_is_named():
    from workbench.adapters.vllm.listener import _patched
    from workbench.adapters.vllm.stream import decode
    n = 10
    ref = np.arange(4, dtype=np.int32)
    frames = [b"step", json.dumps({"step": 3, "num_blocks": n, "slice_lo": 6}).encode(),
              ref.tobytes(), np.full(4, 2, np.int32).tobytes(), np.ones(4, np.uint8).tobytes()]
    kind, header, arrays = decode(frames)
    pool = _patched(None, 3, n, header["slice_lo"], arrays)
    assert pool.ref.tolist() == [0] * 6 + [0, 1, 2, 3] and pool.owner.tolist() == [-1] * 6 + [2] * 4
    again = _patched(pool, 4, n, 0, {"ref": np.full(3, 7, np.int32), "owner": np.zeros(3, np.int32),
                                     "cached": np.zeros(3, np.uint8)})
    assert again.ref.tolist() == [7, 7, 7, 0, 0, 0, 0, 1, 2, 3] and pool.ref[0] == 0       # the old view kept
    bad = [b"step", json.dumps({"step": 5, "num_blocks": n, "slice_lo": 8}).encode(), *frames[2:]]
    with pytest.raises(ValueError, match="slice of 4 blocks at 8 does not fit num_blocks 10"):
        decode(bad)


def test_pin_counts_is_the_per_block_lookup_it_replaces():
    # the pool check's pins per checked block, vectorised: the same as len(pins.get(b, ())) for each
    import numpy as np
    from workbench.adapters.vllm.engine_side import pin_counts
    rng = np.random.default_rng(3)
    for _ in range(50):
        pins = {int(b): ["why"] * int(rng.integers(1, 4)) for b in rng.choice(1000, int(rng.integers(0, 20)), False)}
        idx = rng.integers(0, 1000, int(rng.integers(0, 600))).astype(np.int64)
        want = np.array([len(pins.get(int(b), ())) for b in idx], dtype=np.int64)
        assert np.array_equal(pin_counts(pins, idx), want)
