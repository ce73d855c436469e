"""Our engine against references of its own: request lifecycle accounting (request_lifecycle) and
the page write ledger behind the prefix-cache check (prefix_cache). Each bug is planted through a
declared fault seam of the real code path; each test asserts the output (or what the caller gets)
really changed and that the finding names the right request and page. Clean runs stay silent,
including a long one with preemption, prefix hits, aborts and a 64-thread submission storm.
"""
import threading

import numpy as np

from probes.page_writes import PageWriteLedger, prefix_digests
from probes.request_books import RequestBooks
from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults

PROBES = ("request_lifecycle", "prefix_cache")
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def engine(path, **kw):
    return Engine.from_pretrained(path, EngineConfig(**{"num_pages": 32, "max_num_batched_tokens": 64, **kw}))


def errors(wb, kind=None):
    return [f for f in wb.findings_at_least("error") if kind is None or f.kind == kind]


def drive(eng, limit=400):
    """Step until nothing is left (or `limit` steps); every output, in order."""
    outs = []
    for _ in range(limit):
        if not eng.has_unfinished():
            break
        outs.extend(eng.step())
    return outs


def finals(outs):
    return [(o.request_id, o.finish_reason) for o in outs if o.finished]


# ---- the books and the ledger on their own -------------------------------------------------------
def test_books_name_the_lost_the_doubled_and_the_ended_but_queued():
    b = RequestBooks(grace_steps=1)
    for rid in (1, 2, 3, 4):
        b.handed_out(rid, 0)
    assert b.reconcile(1, {"intake": [1, 2, 3, 4]}) == []
    assert [p.kind for p in b.reconcile(2, {"intake": [4], "waiting": [1, 3], "running": [2, 3]})] == ["two-places"]
    lost = b.reconcile(3, {"running": [1, 2, 3]})
    assert [(p.kind, p.request, p.evidence["last_place"], p.evidence["last_step"]) for p in lost] == \
        [("lost", 4, "intake", 2)]
    assert b.ended_now(2, "finished", 4, "stop") is None
    twice = b.ended_now(2, "aborted", 5, "abort")
    assert twice.kind == "ended-twice" and twice.request == 2 and "step 4" in twice.message
    queued = b.reconcile(6, {"running": [1, 3], "waiting": [2]})
    assert [(p.kind, p.request, p.evidence["places"]) for p in queued] == [("ended-but-queued", 2, ["waiting"])]
    assert b.reconcile(7, {"running": [1, 3, 99]}) == []          # unknown: within its grace
    assert [p.kind for p in b.reconcile(8, {"running": [1, 3, 99]})] == ["unknown"]


def test_ledger_digests_equal_the_reference_across_chunks_and_decodes():
    rng = np.random.default_rng(0)
    ps, led = 4, PageWriteLedger(16, 4)
    a = rng.integers(0, 50, 11).tolist()
    b = a[:8] + rng.integers(0, 50, 5).tolist()          # shares a's first two pages
    # a: a chunk of 6, then 5, then a decode; slots on pages 0, 1, 2, 3 in that order
    pages_a = [0, 1, 2, 3]
    slot = lambda pages, pos: pages[pos // ps] * ps + pos % ps
    for c, n in ((0, 6), (6, 5)):
        assert led.step([(0, a, c, n, pages_a)], np.array([slot(pages_a, p) for p in range(c, c + n)])) == []
    a.append(7)
    assert led.step([(0, a, 11, 1, pages_a)], np.array([slot(pages_a, 11)])) == []
    assert np.array_equal(led.digest[[slot(pages_a, p) for p in range(12)]], prefix_digests(a))
    # b hits a's pages 0 and 1 (8 positions), writes 8..12 on pages 5, 6: its own history there
    pages_b = [0, 1, 5, 6]
    assert led.step([(1, b, 8, 5, pages_b)], np.array([slot(pages_b, p) for p in range(8, 13)])) == []
    assert led.verified == [(1, 0, 8)]
    # c's history differs at position 5: a hit on a's pages 0 and 1 is a mismatch there
    c = a[:5] + [a[5] + 1] + a[6:8] + [9, 9]
    (m,) = led.step([(2, c, 8, 2, [0, 1, 7])], np.array([7 * ps, 7 * ps + 1]))
    assert (m.request, m.position, m.page, m.page_index, m.written_by, m.written_pos) == (2, 5, 1, 1, 0, 5)
    assert led.audit_page(0, 0, a[:4]) is None and "other tokens" in led.audit_page(0, 0, c[1:5])
    assert "positions 4..7" in led.audit_page(1, 0, None)


# ---- request lifecycle: planted through the seams --------------------------------------------------
def test_a_request_lost_in_intake_is_named_with_where_it_was_last_seen(sharp_llama_dir):
    eng = engine(sharp_llama_dir)
    wb = Workbench(eng, log=False).attach(*PROBES)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    with faults.inject(eng, "intake_loses_request", nth=2) as f:
        ids = [eng.add_request(p, GREEDY) for p in prompts]
        outs = drive(eng)
    assert f.lost == [ids[1]]
    done = {rid for rid, _ in finals(outs)}
    assert done == {ids[0], ids[2]} and not eng.has_unfinished()     # the caller of ids[1] waits forever
    (lost,) = errors(wb, "request-lost")
    assert lost.request_id == ids[1] and lost.evidence["last_place"] == "intake"
    assert lost.evidence["last_step"] == 0 and "step 1" in lost.message


def test_a_request_finished_then_aborted_is_named_once_ended_twice(sharp_llama_dir):
    eng = engine(sharp_llama_dir)
    wb = Workbench(eng, log=False).attach(*PROBES)
    with faults.inject(eng, "finish_then_abort"):
        rid = eng.add_request([5, 6, 7, 8, 9], GREEDY)
        outs = drive(eng)
        eng.abort(rid)                                # the client disconnects as the last token streams
        outs += eng.step()
    assert finals(outs) == [(rid, "length"), (rid, "abort")]          # two final outputs for one request
    (twice,) = errors(wb, "request-ended-twice")
    assert twice.request_id == rid and twice.evidence["first"] == "finished" and twice.evidence["second"] == "aborted"
    clean = engine(sharp_llama_dir)
    wb2 = Workbench(clean, log=False).attach(*PROBES)
    rid = clean.add_request([5, 6, 7, 8, 9], GREEDY)
    outs = drive(clean)
    clean.abort(rid)
    outs += clean.step()
    assert finals(outs) == [(rid, "length")] and wb2.findings_at_least("warn") == []


def test_an_aborted_request_left_in_waiting_is_named(sharp_llama_dir):
    eng = engine(sharp_llama_dir, max_num_seqs=1)
    wb = Workbench(eng, log=False).attach(*PROBES)
    with faults.inject(eng, "abort_leaves_waiting") as f:
        ids = [eng.add_request([5 + i, 6, 7, 8], GREEDY) for i in range(3)]
        eng.step()
        eng.abort(ids[2])                             # still waiting behind ids[0] and ids[1]
        eng.step()
        assert ids[2] in [s.request_id for s in eng.scheduler.waiting]      # the bug really left it there
        outs = drive(eng)
    assert f.left == [ids[2]]
    assert [r for r, _ in finals(outs)].count(ids[2]) == 1            # it ran again and finished again
    (queued,) = errors(wb, "request-ended-but-queued")
    assert queued.request_id == ids[2] and queued.evidence["places"] == ["waiting"]
    assert queued.evidence["ended"] == "aborted"
    assert any(e.request_id == ids[2] for e in errors(wb, "request-ended-twice"))


# ---- the page write ledger: planted through the seams ----------------------------------------------
def _prefix_workload(seed=3):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 256, 32).tolist()                       # two full pages of 16
    a = prefix + rng.integers(3, 256, 6).tolist()
    b = rng.integers(3, 256, 100).tolist()                           # long enough to take every free page
    c = prefix + rng.integers(3, 256, 5).tolist()
    return a, b, c


def _run_abc(path, fault=None, **params):
    eng = engine(path, num_pages=8)
    wb = Workbench(eng, log=False).attach(*PROBES, "page_table", "packing")
    a, b, c = _prefix_workload()
    ids, outs = [], {}
    ctx = faults.inject(eng, fault, **params) if fault else None
    f = ctx.__enter__() if ctx else None
    try:
        for p in (a, b, c):
            out = eng.generate([p], GREEDY)[0]
            ids.append(out.request_id)
            outs[out.request_id] = (out.token_ids, out.num_cached_tokens)
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
    return eng, wb, ids, outs, f


def test_an_eviction_that_keeps_the_index_entry_is_named(sharp_llama_dir):
    _, clean_wb, cids, clean, _ = _run_abc(sharp_llama_dir)
    # clean: b's pages evicted part of a's prefix, so c hits less of it (and recomputes the rest)
    assert clean_wb.findings_at_least("warn") == [] and clean[cids[2]][1] < 32
    eng, wb, ids, outs, f = _run_abc(sharp_llama_dir, "eviction_keeps_index_entry")
    a, b, c = ids
    assert f.kept and outs[c][1] == 32 and outs[c][0] != clean[cids[2]][0]        # c's text changed
    stale = errors(wb, "prefix-index-stale")
    kept_pages = {p for _, p in f.kept}
    assert stale and stale[0].page in kept_pages and stale[0].request_id == b
    assert stale[0].evidence["held_before"] == a
    hit = errors(wb, "prefix-history")
    assert hit and hit[0].request_id == c and hit[0].page in kept_pages and hit[0].evidence["computed_by"] == b


def test_an_index_entry_whose_page_another_request_rewrote_is_named(sharp_llama_dir):
    _, _, cids, clean, _ = _run_abc(sharp_llama_dir)
    eng, wb, ids, outs, f = _run_abc(sharp_llama_dir, "write_into_cached_page")
    a, b, c = ids
    (r,) = f.redirected
    assert r["request_id"] == b and outs[c][0] != clean[cids[2]][0]
    stale = errors(wb, "prefix-index-stale")
    assert stale and stale[0].page == r["page"] and stale[0].request_id == b
    assert stale[0].evidence["held_before"] == a
    hit = errors(wb, "prefix-history")
    assert hit and hit[0].request_id == c and hit[0].page == r["page"] and hit[0].evidence["computed_by"] == b
    assert hit[0].evidence["position"] == hit[0].evidence["page_index"] * 16 + r["position"] % 16


# ---- clean and long: preemption, prefix hits, aborts, a 64-thread storm --------------------------------
def test_a_long_clean_run_with_a_submission_storm_is_silent(sharp_llama_dir):
    eng = engine(sharp_llama_dir, num_pages=24, max_num_seqs=16)
    wb = Workbench(eng, log=False).attach(*PROBES, "forward_progress")
    rng = np.random.default_rng(11)
    prefixes = [rng.integers(3, 256, 32).tolist() for _ in range(3)]
    ids, lock = [], threading.Lock()
    go = threading.Event()

    def submit(k):
        go.wait()
        r = np.random.default_rng(k)
        for j in range(3):
            p = prefixes[(k + j) % 3] + r.integers(3, 256, int(r.integers(1, 40))).tolist()
            rid = eng.add_request(p, SamplingParams(max_tokens=int(r.integers(2, 24)), ignore_eos=True))
            with lock:
                ids.append(rid)
            if (k + j) % 7 == 0:
                eng.abort(rid)

    threads = [threading.Thread(target=submit, args=(k,)) for k in range(64)]
    for t in threads:
        t.start()
    go.set()
    outs = []
    while any(t.is_alive() for t in threads) or eng.has_unfinished():
        outs.extend(eng.step())
    for t in threads:
        t.join()
    outs.extend(drive(eng))
    assert len(ids) == 192 and sorted(r for r, _ in finals(outs)) == sorted(ids)
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0
    assert any(reason == "abort" for _, reason in finals(outs))
    assert [(f.probe, f.kind, f.message) for f in wb.findings_at_least("warn")] == []
    books = wb.probe("request_lifecycle").books
    assert books.handed_out_count == books.ended_count == 192 and not books.live
    pc = wb.probe("prefix_cache")
    assert pc.hits_checked > 0 and pc.index_pages_checked > 0 and pc.ledger.slots_written > 0


def test_a_preemption_that_drops_its_victim_is_named_lost(sharp_llama_dir, monkeypatch):
    # Not a catalogue fault: Scheduler._preempt patched on the class the engine calls, as a refactor might
    # write it: the victim's pages are released, but it is never put back in the waiting queue.
    from workbench.engine.scheduler import Scheduler
    dropped = []

    def preempt_and_forget(self, seq):
        seq.last_preemption = (len(seq.pages), seq.num_computed_tokens)
        self._drop(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        dropped.append(seq.request_id)                      # the bug: no self.waiting.appendleft(seq)
    monkeypatch.setattr(Scheduler, "_preempt", preempt_and_forget)
    eng = engine(sharp_llama_dir, num_pages=10, max_num_seqs=8)
    wb = Workbench(eng, log=False).attach(*PROBES)
    rng = np.random.default_rng(4)
    ids = [eng.add_request(rng.integers(3, 256, 30).tolist(), SamplingParams(max_tokens=40, ignore_eos=True))
           for _ in range(4)]
    outs = drive(eng)
    assert dropped and not eng.has_unfinished()
    assert {r for r, _ in finals(outs)} == set(ids) - set(dropped)           # their callers never hear back
    lost = errors(wb, "request-lost")
    assert {f.request_id for f in lost} == set(dropped)
    assert all(f.evidence["last_place"] == "running" for f in lost)


# ---- the ledger's compiled step (probes/page_writes_native.py) ---------------------------------------
def test_the_compiled_ledger_step_is_tried_against_numpy_and_blind_ones_refused():
    import pytest
    from conftest import require_compiled
    from probes import page_writes_native as native
    mod = require_compiled(native.STEP, "the compiled page write ledger")
    native.trial(mod)                     # what the loader ran once: the real module passes

    class Blind:                          # leaves nothing to numpy: a mismatching hit reads clean
        @staticmethod
        def step(*a):
            got = mod.step(*a)
            return got if got is not None else ([], 0, 0, [])
    with pytest.raises(AssertionError, match="a hit on another history: the compiled step called a mismatching"):
        native.trial(Blind)

    class Skewed:                         # records the writes, one digest off
        @staticmethod
        def step(rows, sm, state, seed, writer, pos, tok, digest, *rest):
            got = mod.step(rows, sm, state, seed, writer, pos, tok, digest, *rest)
            if got is not None and sm is not None and len(sm):
                digest[sm[0]] += np.uint64(1)
            return got
    with pytest.raises(AssertionError, match="a prefill: the compiled step wrote another digest"):
        native.trial(Skewed)


def test_the_compiled_ledger_keeps_the_numpy_ledgers_books(sharp_llama_dir, monkeypatch):
    # one workload with prefix hits, chunks and preemption, twice: the ledger's arrays, running digests and
    # rows are the same whichever step ran, and the compiled one answered every step
    from conftest import require_compiled
    from probes import page_writes_native as native
    require_compiled(native.STEP, "the compiled page write ledger")
    rng = np.random.default_rng(4)
    prefix = rng.integers(3, 256, 40).tolist()
    prompts = [prefix + rng.integers(3, 256, n).tolist() for n in (5, 30, 60, 12)] + [rng.integers(3, 256, 70).tolist()]
    real, answered, seen = native.step, [], []
    for compiled in (True, False):
        monkeypatch.setattr(native, "step", (lambda *a: answered.append(real(*a)) or answered[-1]) if compiled
                            else (lambda *a: None))
        eng = engine(sharp_llama_dir, num_pages=14)
        wb = Workbench(eng, log=False).attach(*PROBES)
        outs = eng.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        pc = wb.probe("prefix_cache")
        assert errors(wb) == [] and eng.stats()["num_preemptions"] > 0 and pc.hits_checked > 0
        led = pc.ledger
        seen.append(([o.token_ids for o in outs], pc.frame(), led.state, led.positions_checked, led.slots_written,
                     [getattr(led, n).copy() for n in ("writer", "pos", "tok", "digest")]))
    assert answered and all(a is not None for a in answered)
    (t1, f1, s1, c1, w1, a1), (t2, f2, s2, c2, w2, a2) = seen
    assert t1 == t2 and f1.equals(f2) and s1 == s2 and (c1, w1) == (c2, w2)
    assert all(np.array_equal(x, y) for x, y in zip(a1, a2))
