"""Locks: the wait-for graph on real threads, the watchdog, lock_storm and lock_inversion end to end."""
import threading
import time

import pytest
import torch

from probes.lock_contention import LockContentionProbe
from workbench import ConfigError, Engine, EngineConfig, SamplingParams, faults
from workbench.events import EventBus, LockWaited
from workbench.locks import InstrumentedLock, find_cycle, wait_for_graph
from workbench.watchdog import Watchdog

PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(20 + 5 * i)] for i in range(8)]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
BOUND_S = 30.0          # upper bound for anything that waits on another thread; never a timing assert


def _until(cond, bound=BOUND_S):
    end = time.monotonic() + bound
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def _engine(tiny_llama_dir, **kw):
    return Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=256, **kw))


# ---- the wait-for graph ---------------------------------------------------------------
def test_wait_for_graph_finds_a_real_deadlock_and_not_the_thread_behind_it():
    x, y = InstrumentedLock("x"), InstrumentedLock("y")
    both, broken = threading.Barrier(2), threading.Event()

    def t1():
        with x:
            both.wait()
            with y:                      # y is held by T2: blocks
                pass

    def t2():
        y.acquire()
        both.wait()
        x.acquire()                      # x is held by T1: blocks -> deadlock
        x.release()
        if not broken.is_set():
            y.release()

    a = threading.Thread(target=t1, name="T1", daemon=True)
    b = threading.Thread(target=t2, name="T2", daemon=True)
    a.start(), b.start()
    assert _until(lambda: a.ident in y.waiters and b.ident in x.waiters)
    c = threading.Thread(target=lambda: (x.acquire(), x.release()), name="T3", daemon=True)
    c.start()
    assert _until(lambda: c.ident in x.waiters)

    edges = wait_for_graph([x, y])
    got = {(e.waiter_name, e.lock, e.holder_name) for e in edges}
    assert got == {("T1", "y", "T2"), ("T2", "x", "T1"), ("T3", "x", "T1")}
    cycle = find_cycle(edges)
    assert {e.waiter_name for e in cycle} == {"T1", "T2"} and {e.lock for e in cycle} == {"x", "y"}
    for e, nxt in zip(cycle, cycle[1:] + cycle[:1]):
        assert e.holder == nxt.waiter                     # a closed walk waiter -> lock -> holder
    assert all(e.waited_s >= 0 and e.held_s is not None for e in cycle)

    broken.set()
    y.release()                           # on T2's behalf: T1 gets y, finishes, lets x go
    for t in (a, b, c):
        t.join(BOUND_S)
        assert not t.is_alive()
    assert wait_for_graph([x, y]) == [] and find_cycle(wait_for_graph([x, y])) == []
    assert not x.locked() and not y.locked()


def test_a_wait_chain_is_not_a_cycle():
    a = InstrumentedLock("a")
    go = threading.Event()

    def holder():
        with a:
            go.wait(BOUND_S)

    h = threading.Thread(target=holder, name="holder", daemon=True)
    h.start()
    assert _until(lambda: a.holder == h.ident)
    w = threading.Thread(target=lambda: (a.acquire(), a.release()), name="waiter", daemon=True)
    w.start()
    assert _until(lambda: w.ident in a.waiters)
    edges = wait_for_graph([a])
    assert [(e.waiter_name, e.lock, e.holder_name) for e in edges] == [("waiter", "a", "holder")]
    assert edges[0].holder == h.ident and edges[0].waited_s >= 0 and find_cycle(edges) == []
    go.set()
    h.join(BOUND_S), w.join(BOUND_S)
    assert not h.is_alive() and not w.is_alive() and a.num_contended == 1 and a.num_acquires == 2


def test_uncontended_acquires_report_zero_wait_contended_ones_more():
    bus, seen = EventBus(), []
    bus.subscribe(LockWaited, seen.append)
    lk = InstrumentedLock("l", bus)
    with lk:
        pass
    assert seen[-1].wait_ns == 0 and "test_locks.py" in seen[-1].site
    hold = threading.Event()
    t = threading.Thread(target=lambda: (lk.acquire(), hold.wait(BOUND_S), lk.release()), daemon=True)
    lk.acquire()
    t.start()
    assert _until(lambda: t.ident in lk.waiters)
    lk.release()
    assert _until(lambda: lk.holder == t.ident)
    hold.set()
    t.join(BOUND_S)
    assert seen[-1].wait_ns > 0 and lk.num_contended == 1


# ---- config and the sharded engine ------------------------------------------------------
def test_page_table_lock_config(tiny_llama_dir):
    with pytest.raises(ConfigError, match="page_table_lock"):
        EngineConfig(page_table_lock="per-request")
    g = _engine(tiny_llama_dir)
    assert g.table_lock(0) is g.lock and g.table_lock(5) is g.lock and not g.table_locks
    s = _engine(tiny_llama_dir, page_table_lock="sharded")
    shards = {id(s.table_lock(i)) for i in range(4)}
    assert len(shards) == 4 and id(s.lock) not in shards


@pytest.mark.parametrize("mode", ["global", "sharded"])
def test_stats_reader_vs_the_step_lock(tiny_llama_dir, mode):
    eng = _engine(tiny_llama_dir, page_table_lock=mode)
    eng.generate(PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True))
    live = eng._stats()
    got = {}
    with eng.lock:                       # the step lock is held (a step in flight)
        r = threading.Thread(target=lambda: got.setdefault("s", eng.stats()), daemon=True)
        r.start()
        r.join(0.5 if mode == "global" else BOUND_S)
        blocked = r.is_alive()
    r.join(BOUND_S)
    assert got["s"] == live              # snapshot or not, the same numbers after the step
    if mode == "global":
        assert blocked                   # stats() waited for the step lock
    else:
        assert not blocked               # the published snapshot needs no step lock


HOLD_S = 1.0            # a long step section; the sharded calls must return well inside it
PROMPT_CALL_S = 0.25    # "promptly": generous on a shared 2-core host (the calls take microseconds)


@pytest.mark.parametrize("mode", ["global", "sharded"])
def test_add_request_abort_and_stats_vs_a_held_step_lock(sharp_llama_dir, mode):
    """The engine's own public paths, not the fault's: while another thread holds engine.lock
    (a long step section), add_request / abort / stats() from a third thread wait for it with
    the global lock and return promptly with the sharded one (a fresh engine: no step yet)."""
    eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=64, page_table_lock=mode))
    seen = []
    eng.bus.subscribe(LockWaited, seen.append)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    first = eng.add_request(PROMPTS[0], params)           # aborted below, while the lock is held
    held, box = threading.Event(), {}

    def step_section():
        with eng.lock:
            held.set()
            time.sleep(HOLD_S)
            box["released"] = time.perf_counter()

    calls = {"add_request": lambda: eng.add_request(PROMPTS[1], params),
             "abort": lambda: eng.abort(first), "stats": eng.stats}
    done = {}

    def call(name):
        t0 = time.perf_counter()
        box[name] = calls[name]()
        done[name] = (t0, time.perf_counter())

    holder = threading.Thread(target=step_section, name="step-section", daemon=True)
    holder.start()
    assert held.wait(BOUND_S)
    callers = [threading.Thread(target=call, args=(n,), name=f"caller-{n}", daemon=True) for n in calls]
    for t in callers:
        t.start()
    for t in callers:
        t.join(BOUND_S)
    holder.join(BOUND_S)
    assert not holder.is_alive() and not any(t.is_alive() for t in callers) and set(done) == set(calls)
    released = box["released"]
    for name, (t0, t1) in done.items():
        if mode == "global":
            assert t1 >= released, f"{name} returned while the step's lock was held"
        else:
            assert t1 < released and t1 - t0 < PROMPT_CALL_S, f"{name} took {t1 - t0:.3f} s"
    # The lock probe's view: which lock each call took, under its own site name.
    sites = {(e.lock, e.site) for e in seen if e.thread.startswith("caller-")}
    for name in calls:
        site = f"engine.py {name}"
        if mode == "global":
            assert ("page_table", site) in sites
            assert max(e.wait_ns for e in seen if e.site == site) > 0.1e9   # it queued on the step's lock
        elif name == "stats":
            assert not [lk for lk, s in sites if s == site]              # a snapshot read: no lock at all
        else:                                                            # its request's shard, never page_table
            key = first if name == "abort" else box["add_request"]
            assert {lk for lk, s in sites if s == site} == {eng.table_lock(key).name}
    if mode == "sharded":
        assert box["stats"]["steps"] == 0 and box["stats"]["pages_total"] == 64   # published at construction

    # The calls did what they say: the first request is aborted, the second runs.
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert outs[first].finish_reason == "abort" and outs[box["add_request"]].finish_reason == "length"
    assert eng.stats() == eng._stats() and eng.stats()["num_waiting"] == 0


def test_sharded_stats_snapshot_is_fresh(sharp_llama_dir):
    eng = Engine.from_pretrained(sharp_llama_dir, EngineConfig(num_pages=64, page_table_lock="sharded"))
    assert eng.stats() == eng._stats() and eng.stats()["steps"] == 0     # before any step
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    a = eng.add_request(PROMPTS[2], params)
    assert eng.stats()["num_waiting"] == 1          # counted at add_request, before the engine drains it
    b = eng.add_request(PROMPTS[2], params)
    assert eng.stats()["num_waiting"] == 2
    eng.step()
    assert eng.stats() == eng._stats() and eng.stats()["num_running"] == 2
    eng.abort(b)
    eng.abort(-7)                                   # an id the engine never issues: nothing queued
    eng.step()
    st = eng.stats()
    assert st == eng._stats() and st["num_running"] == 1
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["pages_cached"] > 0          # the finished prompt's full pages stay cached
    assert eng.reset_prefix_cache() > 0
    assert eng.stats() == eng._stats() and eng.stats()["pages_cached"] == 0
    assert a >= 0 and not eng.has_unfinished()


# ---- lock_storm -----------------------------------------------------------------------
def _run(eng, probe_kw=None):
    """generate with a fresh probe; returns (outputs, engine wait share on page_table, probe)."""
    probe = LockContentionProbe(**(probe_kw or {})).attach(eng)
    outs = eng.generate(PROMPTS, PARAMS)
    share = probe.wait_share("page_table")
    probe.detach()                       # flushes the last window and stops the watchdog
    return outs, share, probe


@pytest.fixture()
def one_torch_thread():
    # On a loaded 2-core host, two intra-op threads spin against each other and the step's
    # compute swells tenfold, drowning the lock wait the test measures; restore afterwards.
    n = torch.get_num_threads()
    yield 1
    torch.set_num_threads(n)


def test_lock_storm_caught_and_sharding_fixes_it(tiny_llama_dir, one_torch_thread):
    eng = _engine(tiny_llama_dir, num_threads=one_torch_thread)
    eng.generate(PROMPTS[:2], PARAMS)    # warm-up
    ref, off_share, off = _run(eng)
    assert not [f for f in off.findings if f.at_least("warn")]
    assert off_share < 0.05

    # sized from this host's step time (a fixed hold is a smaller share of a slower host's step): at least
    # the fault's 5 ms copy, a quarter of a step where steps are longer
    hold_s = max(0.005, off.steps_frame()["duration_ms"].median() / 4e3)
    with faults.inject(eng, "lock_storm", hold_s=hold_s) as storm:
        outs, on_share, on = _run(eng)
    assert storm.updates > 0 and storm.scrapes > 0
    assert not [t for t in threading.enumerate() if t.name.startswith(("stream-", "metrics-"))]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]     # requests untouched: only slower
    assert on_share > 0.30 and on_share > 5 * off_share
    errs = [f for f in on.findings if f.at_least("error")]
    assert errs and errs[0].lock == "page_table" and "page_table" in errs[0].message
    assert "lock_storm.py" in errs[0].message                     # the top contending call site
    assert "page_table_lock='sharded'" in errs[0].hint
    df = on.frame()
    storm_rows = df[(df.lock == "page_table") & df.site.str.contains("lock_storm.py")]
    step_rows = df[(df.lock == "page_table") & df.site.str.contains("engine.py")]
    assert len(storm_rows) == 1 and storm_rows.contention_ratio.iloc[0] > 0.5
    assert (step_rows["count"] > 0).all() and step_rows.contended.sum() > 0
    w = df[df["count"] > 0]              # (a hold begun before attach has no wait sample)
    assert (w.wait_max_ms >= w.wait_p99_ms).all() and (w.wait_p99_ms >= w.wait_p50_ms).all()

    # The storm went through the engine's real paths too: abort() (the streams) and stats()
    # (the scrapers) queued on the step's lock under their own site names.
    assert storm.aborts > 0 and storm.calls["abort"] and storm.calls["stats"]
    real = df[(df.lock == "page_table") & df.site.isin(["engine.py abort", "engine.py stats"])]
    assert len(real) == 2 and real.contended.sum() > 0
    assert not eng.has_unfinished()                  # the streams' aborts name no request: nothing queued

    sharded = _engine(tiny_llama_dir, page_table_lock="sharded", num_threads=one_torch_thread)
    sharded.generate(PROMPTS[:2], PARAMS)
    with faults.inject(sharded, "lock_storm", hold_s=hold_s) as storm2:
        outs2, fixed_share, fixed = _run(sharded)
    assert storm2.updates > 0 and storm2.scrapes > 0 and storm2.aborts > 0
    assert [o.token_ids for o in outs2] == [o.token_ids for o in ref]
    assert fixed_share < 0.05 and fixed_share < on_share / 5
    assert not [f for f in fixed.findings if f.at_least("warn") and f.lock == "page_table"]
    shard_rows = fixed.frame()
    assert shard_rows.lock.str.startswith("page_table[").any()     # the storm went to its shards
    # Nothing but the step (engine/step.py) takes the step's lock now, so it never waits for it; the streams'
    # aborts, the scrapers' stats() and generate()'s add_request calls are on shards or no lock.
    on_table = shard_rows[shard_rows.lock == "page_table"]
    assert on_table.contended.sum() == 0 and on_table.site.str.contains("step.py:").all()
    assert not on_table.site.isin(["engine.py add_request", "engine.py abort", "engine.py stats"]).any()
    shard_sites = set(shard_rows[shard_rows.lock.str.startswith("page_table[")].site)
    assert {"engine.py abort", "engine.py add_request"} <= shard_sites
    # A warning on a shard is possible and true: generate() submits on the engine's own
    # thread, so when one of its add_request calls lands on a shard a storm stream holds
    # across its 5 ms copy, the probe charges that wait to the engine thread's next step.
    # With this tiny model a step is ~2 ms, so one such wait can be a large share.
    for f in fixed.findings:
        if f.at_least("warn"):
            assert f.lock.startswith("page_table[") and "lock_storm.py" in f.message, f.message


# ---- the watchdog and lock_inversion -------------------------------------------------------
def _step_in_thread(eng):
    box = {}

    def run():
        try:
            box["out"] = eng.step()
        except BaseException as e:       # noqa: BLE001 - surfaced by the test
            box["err"] = e

    t = threading.Thread(target=run, name="engine", daemon=True)
    t.start()
    return t, box


def test_watchdog_names_the_lock_holder_of_a_stalled_step(tiny_llama_dir):
    eng = _engine(tiny_llama_dir)
    eng.generate(PROMPTS[:1], SamplingParams(max_tokens=2, ignore_eos=True))   # warm-up
    dog = Watchdog(eng, deadline_s=0.3).start()
    assert dog.thread.daemon and dog.check() is None          # an idle engine is not a stuck one
    eng.add_request(PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.lock.acquire()                   # this thread sits on the page-table lock
    try:
        t, box = _step_in_thread(eng)
        assert _until(lambda: dog.findings)
        assert t.is_alive()
    finally:
        eng.lock.release()
    t.join(BOUND_S)
    assert not t.is_alive() and "err" not in box
    dog.stop()
    assert not dog.running
    [f] = dog.findings                    # one finding per stuck step
    assert f.severity == "critical" and f.kind == "step-stalled" and f.lock == "page_table"
    assert "'engine'" in f.message and "MainThread" in f.message and f.evidence["cycle"] == []
    assert any(k.startswith("engine ") and "acquire" in v for k, v in f.evidence["stacks"].items())


def test_the_watchdog_of_an_idle_engine_ignores_another_engines_step_on_the_same_thread(tiny_llama_dir):
    """One thread drives two engines (the lock_storm notebook: the global-lock engine, then the sharded
    one). Engine A went idle after its last step; later the same thread sits in engine B's step, stalled
    on B's lock. A's watchdog must stay silent (on a slow host that came 60 s after A's last step start
    and was reported as A's step stalled on B's lock); B's watchdog names B's stall."""
    a, b = _engine(tiny_llama_dir), _engine(tiny_llama_dir)
    a.generate(PROMPTS[:1], SamplingParams(max_tokens=1, ignore_eos=True))      # warm-up
    dog_a, dog_b = Watchdog(a, deadline_s=0.3).start(), Watchdog(b, deadline_s=0.3).start()
    b.add_request(PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True))
    box = {}

    def one_thread_two_engines():
        try:
            a.generate(PROMPTS[:1], SamplingParams(max_tokens=2, ignore_eos=True))   # A's last step, then idle
            box["out"] = b.step()                                                  # stalls on B's lock
        except BaseException as e:       # noqa: BLE001 - surfaced by the test
            box["err"] = e
    b.lock.acquire()
    try:
        t = threading.Thread(target=one_thread_two_engines, name="driver", daemon=True)
        t.start()
        assert _until(lambda: dog_b.findings)
        assert a.step_thread_id == t.ident                # A's heartbeat names the thread now in B's step
        time.sleep(0.6)                  # A's watchdog polls past its deadline all the while
    finally:
        b.lock.release()
    t.join(BOUND_S)
    dog_a.stop()
    dog_b.stop()
    assert not t.is_alive() and "err" not in box
    [f] = dog_b.findings
    assert f.kind == "step-stalled" and f.lock == "page_table" and "'driver'" in f.message
    assert dog_a.findings == []
    # and a thread that was in A's step before is judged by A's frames, not by B's: A still catches its own
    a.add_request(PROMPTS[2], SamplingParams(max_tokens=2, ignore_eos=True))
    dog_a = Watchdog(a, deadline_s=0.3).start()
    a.lock.acquire()
    try:
        t, box = _step_in_thread(a)
        assert _until(lambda: dog_a.findings)
    finally:
        a.lock.release()
    t.join(BOUND_S)
    dog_a.stop()
    assert [f.kind for f in dog_a.findings] == ["step-stalled"]


def test_lock_inversion_hangs_the_step_and_the_watchdog_names_the_cycle(tiny_llama_dir):
    eng = _engine(tiny_llama_dir)
    probe = LockContentionProbe(deadline_s=0.5).attach(eng)
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))
    with faults.inject(eng, "lock_inversion") as fault:
        assert fault.deadlocked
        t, box = _step_in_thread(eng)
        assert _until(lambda: any(f.severity == "critical" for f in probe.findings))
        assert t.is_alive()              # the step really hangs
    t.join(BOUND_S)                      # disable() broke the deadlock: the step completes
    assert not t.is_alive() and "err" not in box and len(box["out"]) == 1
    [f] = [f for f in probe.findings if f.severity == "critical"]
    assert f.kind == "deadlock" and f.probe == "lock_contention"
    for name in ("page_table", "stream_context", "stream-A", "stream-B", "'engine'"):
        assert name in f.message, name
    assert set(f.evidence["cycle_locks"]) == {"page_table", "stream_context"}
    assert set(f.evidence["cycle_threads"]) == {"stream-A", "stream-B"}
    assert {r["lock"] for r in f.evidence["locks"]} >= {"page_table", "stream_context"}
    assert any(k.startswith("stream-A ") for k in f.evidence["stacks"])
    assert "one global order" in f.hint
    dog = probe.watchdog
    probe.detach()
    assert not dog.running and not eng.bus.wants(LockWaited)
    assert not [x for x in threading.enumerate() if x.name in ("stream-A", "stream-B")]
    assert not eng.lock.locked()
    outs = eng.generate(PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True))   # runs clean after
    assert all(o.finished for o in outs)
