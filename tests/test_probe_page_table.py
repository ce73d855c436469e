"""page_table probe, and the faults it names: stale_binding, page_out_of_range, free_while_shared.

Each fault test runs the same greedy workload three ways on fresh engines: clean with the
probe (no finding >= warn), faulty with the probe (the symptom is real: the token ids
change against the clean run; the probe names the request and page within a bounded
number of steps), and clean again on the faulty engine after the with-block.
"""
from collections import Counter

import numpy as np
import pytest
import torch

from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.events import EVENT_TYPES, BatchPacked, StepFinished

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def make_engine(path, **kw):
    return Engine.from_pretrained(path, EngineConfig(**{"num_pages": 64, **kw}))


def watched(eng, **params):
    return Workbench(eng, log=False).attach("page_table", page_table=params)


def random_prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in lengths]


def run(eng, prompts, params=GREEDY):
    """Step eng until done: (token ids per prompt, request ids, per step {request id: pages})."""
    ids = [eng.add_request(p, params) for p in prompts]
    done, pages = {}, []
    snap = lambda e: pages.append({s.request_id: list(s.pages) for s in eng.last_batch.seqs})
    eng.bus.subscribe(BatchPacked, snap)              # the pages of every sequence the step runs
    try:
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
    finally:
        eng.bus.unsubscribe(snap)
    return [done[i] for i in ids], ids, pages


def loud(wb, severity="warn"):
    return [(f.kind, f.severity, f.message) for f in wb.findings_at_least(severity)]


# ---- healthy runs ------------------------------------------------------------------
def test_healthy_run_with_sharing_preemption_and_chunking_is_clean(sharp_llama_dir):
    # A shared 3-page prefix (prefix-cache hits), chunked prefill (64-token budget) and a pool
    # too small for everyone (preemption by recompute): every check runs, none fires.
    prefix = random_prompts([48], seed=5)[0]
    prompts = [prefix + p for p in random_prompts([5, 30, 70, 12, 40], seed=6)] + random_prompts([90], seed=7)
    eng = make_engine(sharp_llama_dir, num_pages=16, max_num_batched_tokens=64)
    wb = watched(eng)
    run(eng, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    probe = wb.probe("page_table")
    assert loud(wb) == []
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0
    df = probe.frame()
    assert len(df) == probe.scans and probe.scans > 0 and probe.tables_checked >= probe.scans
    assert df["shared_pages"].max() > 0          # the refcount check saw shared pages
    assert (df[["free_while_mapped", "reused", "refcount_missing", "refcount_leaked", "out_of_range"]] == 0).all().all()


def test_every_samples_the_pool_scan(sharp_llama_dir):
    eng = make_engine(sharp_llama_dir)
    wb = watched(eng, every=4)
    steps = []
    eng.bus.subscribe(StepFinished, lambda e: steps.append(e.step))
    run(eng, random_prompts((10, 20)))
    probe = wb.probe("page_table")
    assert probe.scans == sum(1 for s in steps if s % 4 == 0) and 0 < probe.scans < len(steps)
    assert list(probe.frame()["step"]) == [s for s in steps if s % 4 == 0]
    with pytest.raises(ValueError):
        Workbench(make_engine(sharp_llama_dir), log=False).attach("page_table", page_table={"every": 0})


def test_detach_unwires_everything(sharp_llama_dir):
    eng = make_engine(sharp_llama_dir)
    assert eng.pool.observer is None and eng.model.hooks is None
    wb = watched(eng)
    assert eng.pool.observer is not None and eng.model.hooks is not None and eng.model_hooks.taps
    wb.detach()
    assert eng.pool.observer is None and eng.model.hooks is None and not eng.model_hooks.taps
    assert not any(eng.bus.wants(t) for t in EVENT_TYPES)


# ---- stale_binding ------------------------------------------------------------------
def test_stale_binding_garbles_text_and_is_named(sharp_llama_dir):
    prompts = random_prompts((10, 20, 30))
    eng = make_engine(sharp_llama_dir)
    wb = watched(eng)
    clean, ids, pages = run(eng, prompts)
    assert loud(wb) == []                                            # off: silent
    # The first step in which a decoding sequence grows a page (the allocation is the same
    # with the fault on: scheduling does not depend on token values).
    growth = next(k + 1 for k in range(1, len(pages))
                  if any(len(pages[k][r]) > len(pages[k - 1].get(r, [])) for r in pages[k]))

    eng = make_engine(sharp_llama_dir)
    wb = watched(eng)
    with faults.inject(eng, "stale_binding") as fault:
        bad, ids, _ = run(eng, prompts)
    assert fault.late_binds > 0
    assert bad != clean                                              # the symptom: garbled text
    errs = [f for f in wb.findings_at_least("error") if f.kind == "stale-binding"]
    assert errs and min(f.step for f in errs) <= growth
    for f in errs:
        ev = f.evidence
        assert ev["version_read"] < ev["version_current"] and ev["page_read"] != ev["page_meant"]
        assert {"checksum_read", "checksum_current"} <= set(ev)
        assert f.page in pages[f.step - 1][f.request_id]             # a page the request really maps
    # Every request whose text changed was named no later than the step its text changed
    # (token j is sampled in step j + 1: all prompts are prefilled in step 1).
    for rid, c, b in zip(ids, clean, bad):
        if c != b:
            first = next(j for j, (x, y) in enumerate(zip(c, b)) if x != y) + 1
            assert min(f.step for f in errs if f.request_id == rid) <= first

    wb.reset()                                                       # undone: the engine runs clean
    again, _, _ = run(eng, prompts)
    assert again == clean and loud(wb) == []


# ---- page_out_of_range ----------------------------------------------------------------
def test_an_old_table_bound_mid_forward_is_seen_at_the_last_layer(sharp_llama_dir):
    # the version the kernels read is taken after the first and the last layer's attention (the
    # probe's tap, called at those two layers only): a bind of an old version after layer 0 shows
    # at the last layer, named as such
    from workbench.engine import instrumentation
    from workbench.engine.taps import ModelTap
    eng = make_engine(sharp_llama_dir)
    wb = watched(eng)
    L = eng.model_config.num_layers
    bt = eng.builder.block_tables

    class OldBind(ModelTap):                  # after layer 0's attention, the bound version goes back one
        needs = frozenset({"attention_out"})

        def forward_layers(self, batch):
            return (0,)

        def on_attention_out(self, layer, o, batch):
            if eng.step_count == 3:
                bt.version = bt.host_version - 1

    tap = OldBind()
    instrumentation.add_tap(eng, tap)
    try:
        run(eng, random_prompts((10, 20)))
    finally:
        instrumentation.remove_tap(eng, tap)
    stale = [f for f in wb.findings_at_least("warn") if f.kind == "stale-binding"]
    assert stale and {f.step for f in stale} == {3}, [f.message for f in stale]
    assert all(f.evidence["layer"] == L - 1 and f.evidence["version_read"] < f.evidence["version_current"]
               for f in stale)


def test_page_out_of_range_garbles_one_request_and_is_named(sharp_llama_dir):
    prompts = random_prompts((10, 20, 30))
    eng = make_engine(sharp_llama_dir)
    wb = watched(eng)
    clean, ids, _ = run(eng, prompts)
    assert loud(wb) == []

    eng = make_engine(sharp_llama_dir)
    wb = watched(eng)
    target = ids[1]
    with faults.inject(eng, "page_out_of_range", request_id=target) as fault:
        bad, ids, _ = run(eng, prompts)
    [hit] = fault.corrupted
    n = eng.pool.num_pages
    assert hit["request_id"] == target and hit["page_id"] == n
    # The symptom: that request decodes garbage (NaN read past the pool); the others do not.
    assert bad[1] != clean[1] and bad[0] == clean[0] and bad[2] == clean[2]
    errs = wb.findings_at_least("error")
    assert errs[0].kind == "page-out-of-range" and errs[0].severity == "critical"
    assert (errs[0].request_id, errs[0].page, errs[0].step) == (target, n, hit["step"])
    assert errs[0].evidence["page_meant"] == hit["page_meant"]

    wb.reset()
    again, _, _ = run(eng, prompts)
    assert again == clean and loud(wb) == []


def test_page_out_of_range_checked_read_is_the_illegal_access(sharp_llama_dir):
    # Without the emulated device read, torch's own bounds check fires: the crash production
    # saw as an illegal memory access.
    eng = make_engine(sharp_llama_dir)
    if eng.device.type != "cpu":
        pytest.skip("a device-side assert would poison the accelerator context")
    with faults.inject(eng, "page_out_of_range", unchecked=False):
        with pytest.raises((IndexError, RuntimeError), match="index"):
            run(eng, random_prompts((10, 20)))


# ---- free_while_shared ----------------------------------------------------------------
def shared_prefix_scenario(eng):
    """A and B share a 3-page prefix (B hits A's cached pages); A finishes first; C, a
    stranger, arrives right after and needs pages from a nearly full 8-page pool."""
    rng = np.random.default_rng(7)
    prefix = rng.integers(3, 256, 48).tolist()
    a_ids, b_ids = prefix + rng.integers(3, 256, 8).tolist(), prefix + rng.integers(3, 256, 24).tolist()
    c_ids = rng.integers(3, 256, 64).tolist()
    done = {}

    def step():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids

    a = eng.add_request(a_ids, SamplingParams(max_tokens=4, ignore_eos=True))
    step()
    b = eng.add_request(b_ids, SamplingParams(max_tokens=40, ignore_eos=True))
    step()
    b_seq = next(s for s in eng.scheduler.running if s.request_id == b)
    assert b_seq.num_cached_tokens >= 48                  # a prefix-cache hit on A's pages
    shared = list(b_seq.pages[:3])
    while a not in done:
        step()
    a_done = eng.step_count
    c = eng.add_request(c_ids, SamplingParams(max_tokens=8, ignore_eos=True))
    while eng.has_unfinished():
        step()
    return {"a": done[a], "b": done[b], "c": done[c]}, b, shared, a_done


def test_free_while_shared_garbles_the_survivor_and_is_named(sharp_llama_dir):
    eng = make_engine(sharp_llama_dir, num_pages=8)
    wb = watched(eng)
    clean, _, _, _ = shared_prefix_scenario(eng)
    assert loud(wb) == [] and wb.probe("page_table").frame()["shared_pages"].max() == 3

    eng = make_engine(sharp_llama_dir, num_pages=8)
    wb = watched(eng)
    with faults.inject(eng, "free_while_shared") as fault:
        bad, b, shared, a_done = shared_prefix_scenario(eng)
    assert sorted(p for _, p, _ in fault.forced) == sorted(shared)
    # The symptom, only on the prefix-cache hit: B decodes garbage, A and C are untouched.
    assert bad["b"] != clean["b"] and bad["a"] == clean["a"] and bad["c"] == clean["c"]
    errs = wb.findings_at_least("error")
    first = errs[0]
    assert first.kind == "free-while-mapped" and first.request_id == b and first.page in shared
    assert first.step == a_done                            # named in the step A's release freed them
    kinds = {f.kind for f in errs if f.request_id == b and f.page in shared}
    assert {"free-while-mapped", "refcount", "page-reused"} <= kinds   # C got them: generation moved
    reused = [f for f in errs if f.kind == "page-reused"]
    assert all(f.evidence["generation_now"] > f.evidence["generation_mapped"] for f in reused)

    # Undone, and the pool it leaves is whole: all pages free, no reference left over.
    assert eng.pool.num_free == eng.pool.num_pages and not any(eng.pool.ref)
    wb.reset()
    again, _, _, _ = shared_prefix_scenario(eng)
    assert again == clean and loud(wb) == []


def test_a_probe_bug_never_reaches_the_engine(sharp_llama_dir):
    eng = make_engine(sharp_llama_dir)
    wb = watched(eng)
    probe = wb.probe("page_table")

    class NoPool:                            # the engine as the probe sees it, minus a readable pool
        def __getattr__(self, name):
            if name == "pool":
                raise RuntimeError("pool unreadable")
            return getattr(eng, name)

    probe.engine = NoPool()
    outs = eng.generate(random_prompts((10,)), SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(outs[0].token_ids) == 4
    assert {f.kind for f in probe.findings} == {"probe-error"} and "pool unreadable" in probe.findings[0].message
    probe.engine = eng
    wb.detach()


# ---- the compiled clean paths (probes/page_table_native.py) ------------------------------------
def test_the_compiled_checks_are_tried_against_numpy_and_blind_ones_refused():
    from conftest import require_compiled
    from probes import page_table_native as native
    mod = require_compiled(native.CHECKS, "the compiled page-table checks")
    native.trial(mod)

    class BlindScan:                  # counts the pages right, and says clean whatever the pool holds
        table = staticmethod(mod.table)

        @staticmethod
        def scan(lists, gens, ref, gen, free):
            counts = Counter(p for pages in lists for p in pages)
            return sum(counts.values()), sum(c > 1 for c in counts.values())
    with pytest.raises(AssertionError, match="a page outside the pool"):
        native.trial(BlindScan)

    class BlindTable:                 # any table is clean
        scan = staticmethod(mod.scan)

        @staticmethod
        def table(*a):
            return True
    with pytest.raises(AssertionError, match="table, a page slipped"):
        native.trial(BlindTable)


def test_the_compiled_checks_give_the_numpy_checks_rows(sharp_llama_dir, monkeypatch):
    # the healthy workload above (shared prefixes, chunks, preemption) twice: its scan rows are the
    # same whichever checks ran, and the compiled ones answered every clean table and scan
    from conftest import require_compiled
    from probes import page_table_native as native
    require_compiled(native.CHECKS, "the compiled page-table checks")
    prefix = random_prompts([48], seed=5)[0]
    prompts = [prefix + p for p in random_prompts([5, 30, 70, 12, 40], seed=6)] + random_prompts([90], seed=7)
    frames, answered = [], {"scan": [], "table": []}
    real = {"scan": native.scan, "table": native.table}

    def counted(name):
        def call(*a):
            got = real[name](*a)
            answered[name].append(got is not None and got is not False)
            return got
        return call
    for compiled in (True, False):
        monkeypatch.setattr(native, "scan", counted("scan") if compiled else (lambda *a: None))
        monkeypatch.setattr(native, "table", counted("table") if compiled else (lambda *a: False))
        eng = make_engine(sharp_llama_dir, num_pages=16, max_num_batched_tokens=64)
        wb = watched(eng)
        run(eng, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
        assert loud(wb) == []
        probe = wb.probe("page_table")
        frames.append((probe.frame().drop(columns="scan_us"), probe.tables_checked))
    for name, got in answered.items():
        assert got and all(got), (name, got.count(False))
    assert frames[0][0].equals(frames[1][0]) and frames[0][0]["shared_pages"].max() > 0
    assert frames[0][1] == frames[1][1] == len(answered["table"])
