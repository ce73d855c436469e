"""Bugs nobody planted through faults.inject: each test writes an ordinary engine bug into
the real code path (monkeypatch on the class the engine calls), then asserts that the output
really changed (or pages really leaked) and that a probe's finding (>= error) names the
right request, page or token. The same workloads run clean stay silent.
"""
import numpy as np
import pytest
import torch

from workbench import Engine, EngineConfig, SamplingParams, Workbench
from workbench.engine import kv_manager as kvm
from workbench.engine.batch import BatchBuilder
from workbench.engine.block_table import BlockTables
from workbench.engine.scheduler import Scheduler

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
PROBES = ("page_table", "packing", "pool_accounting", "prefix_cache", "cu_seqlens")


def prompts_with_shared_prefix(seed=5):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 256, 48).tolist()
    return [prefix + rng.integers(3, 256, n).tolist() for n in (5, 30, 70, 12)] + [rng.integers(3, 256, 90).tolist()]


def engine(path, **kw):
    return Engine.from_pretrained(path, EngineConfig(**{"num_pages": 64, "max_num_batched_tokens": 64, **kw}))


def run(path, prompts, params=GREEDY, probes=PROBES, **kw):
    """(token ids per prompt, request ids, workbench, engine) of one run with the probes on."""
    eng = engine(path, **kw)
    wb = Workbench(eng, log=False).attach(*probes, pool_accounting={"every": 1})
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    return [done[i] for i in ids], ids, wb, eng


def errors(wb, kind=None):
    return [f for f in wb.findings_at_least("error") if kind is None or f.kind == kind]


@pytest.fixture(scope="module")
def clean(sharp_llama_dir):
    toks, ids, wb, eng = run(sharp_llama_dir, prompts_with_shared_prefix())
    return toks, ids, wb, eng


def test_clean_run_with_hits_chunks_and_preemption_is_silent(sharp_llama_dir, clean):
    toks, ids, wb, eng = clean
    assert [(f.probe, f.kind, f.message) for f in wb.findings_at_least("warn")] == []
    assert eng.stats()["prefix_cache_hits"] > 0
    assert wb.probe("packing").batches_checked == eng.step_count
    assert wb.probe("prefix_cache").hits_checked > 0 and wb.probe("prefix_cache").registrations_checked > 0
    acc = wb.probe("pool_accounting").frame()
    assert acc["idle"].any() and (acc[["violations", "leaked"]] == 0).all().all()
    # the same with a pool too small for everyone (preemption by recompute)
    _, _, wb2, eng2 = run(sharp_llama_dir, prompts_with_shared_prefix(), num_pages=16)
    assert eng2.stats()["num_preemptions"] > 0
    assert [(f.probe, f.kind, f.message) for f in wb2.findings_at_least("warn")] == []


# ---- 1. the block table the kernel reads ------------------------------------------------
def test_bind_that_keeps_last_steps_width_is_caught(sharp_llama_dir, clean, monkeypatch):
    # A bind that copies as many entries as the last step's table held: when the table grows
    # (a new page, a new sequence) the tail rows keep stale ids, while the stamp says current.
    def bind(self):
        b, w = self._staged_shape
        old = self.shape[0] * self.shape[1]
        n = min(b * w, old) if old else b * w
        self._dev[:n].copy_(self._host[:n])
        self.version, self.checksum, self.shape = self.host_version, self.host_checksum, (b, w)
        return self.view()
    monkeypatch.setattr(BlockTables, "bind", bind)
    toks, ids, wb, _ = run(sharp_llama_dir, prompts_with_shared_prefix())
    assert toks != clean[0]
    found = errors(wb, "block-table-mismatch")
    assert found, [f.message for f in wb.findings_at_least("warn")]
    f = found[0]
    assert f.request_id in ids and f.evidence["page_read"] != f.evidence["page_meant"]
    assert f.page == f.evidence["page_meant"]
    assert f.evidence["host_rows_match"] and not f.evidence["device_equals_host"]   # the bind, not the staging


def test_rows_permuted_for_the_kernel_are_caught(sharp_llama_dir, clean, monkeypatch):
    # The bind publishes the rows sorted longest-first "for the kernel", but the queries stay in
    # batch order: every query reads another sequence's pages.
    real = BlockTables.bind

    def bind(self):
        out = real(self)
        b, w = self._staged_shape
        host = self._host[: b * w].view(b, w)
        order = torch.argsort((host != 0).sum(1), descending=True, stable=True)
        self._dev[: b * w].view(b, w).copy_(host[order])
        return out
    monkeypatch.setattr(BlockTables, "bind", bind)
    toks, ids, wb, eng = run(sharp_llama_dir, prompts_with_shared_prefix())
    assert toks != clean[0]
    found = errors(wb, "block-table-mismatch")
    assert found
    f = found[0]
    # the finding names the request whose row was overwritten and the page it should read
    seq_pages = f.evidence["row_meant"]
    assert f.evidence["page_meant"] == seq_pages[f.evidence["column"]]
    assert f.request_id in ids


def test_table_filled_from_the_wrong_sequences_is_caught(sharp_llama_dir, clean, monkeypatch):
    # fill_host handed the page lists rotated by one (an off-by-one over the batch).
    real = BlockTables.fill_host
    monkeypatch.setattr(BlockTables, "fill_host",
                        lambda self, lists: real(self, lists[1:] + lists[:1] if len(lists) > 1 else lists))
    toks, ids, wb, _ = run(sharp_llama_dir, prompts_with_shared_prefix())
    assert toks != clean[0]
    found = errors(wb, "block-table-mismatch")
    assert found and found[0].request_id in ids
    assert not found[0].evidence["host_rows_match"] and found[0].evidence["device_equals_host"]
    # the slots were computed from the same wrong rows: the packing probe names the token too
    slots = errors(wb, "packing-slot-mapping")
    assert slots and slots[0].evidence["token"] >= 0


# ---- 2. packing ----------------------------------------------------------------------------
def _patch_build(monkeypatch, edit):
    real = BatchBuilder.build

    def build(self, scheduled, *a, **kw):
        batch = real(self, scheduled, *a, **kw)
        edit(batch)
        return batch
    monkeypatch.setattr(BatchBuilder, "build", build)


def test_slot_off_at_a_page_boundary_is_caught(sharp_llama_dir, clean, monkeypatch):
    # The page index of a token is taken as (pos - 1) // page_size: the first token of every
    # page is written into the first slot of the page before it (over older K/V).
    hit = {}

    def edit(batch):
        pos = batch.positions.numpy()
        ps = batch.page_size
        first = np.nonzero((pos % ps == 0) & (pos > 0))[0]
        for t in first.tolist():
            i = int(np.searchsorted(batch.cu_seqlens_q_np, t, side="right") - 1)
            seq = batch.seqs[i]
            batch.slot_mapping[t] = seq.pages[(int(pos[t]) - 1) // ps] * ps
            hit.setdefault("first", (seq.request_id, t, int(pos[t])))
    _patch_build(monkeypatch, edit)
    toks, ids, wb, _ = run(sharp_llama_dir, prompts_with_shared_prefix())
    assert toks != clean[0]
    found = errors(wb, "packing-slot-mapping")
    assert found
    f = found[0]
    assert (f.request_id, f.evidence["token"], f.evidence["position"]) == hit["first"]
    assert f.page == f.evidence["page"] and f.evidence["want"] == f.page * 16


def test_host_copy_out_of_step_is_named_not_the_device_tensor(sharp_llama_dir, clean, monkeypatch):
    # The host context lengths the backend plans from lag one token behind for decodes.
    seen = {}

    def edit(batch):
        q = batch.query_lens_np
        dec = np.nonzero(q == 1)[0]
        if len(dec):
            batch.context_lens_np = batch.context_lens_np.copy()
            batch.context_lens_np[dec] -= 1
            seen.setdefault("request", batch.seqs[int(dec[0])].request_id)
    _patch_build(monkeypatch, edit)
    toks, ids, wb, _ = run(sharp_llama_dir, prompts_with_shared_prefix())
    assert toks != clean[0]
    found = errors(wb, "packing-lengths")
    assert found
    assert {f.evidence["copy"] for f in found} == {"context_lens_np"}
    assert found[0].request_id == seen["request"]
    # the device tensors are right: no probe blames cu_seqlens_k or context_lens
    assert not [f for f in wb.findings_at_least("warn") if f.probe == "cu_seqlens"]


def test_positions_off_by_a_chunk_are_caught(sharp_llama_dir, clean, monkeypatch):
    # A chunk that continues a sequence (after a prefix hit or an earlier chunk) gets its
    # positions counted from the chunk start instead of from the computed tokens.
    seen = {}

    def edit(batch):
        for i, s in enumerate(batch.seqs):
            a, b = int(batch.cu_seqlens_q_np[i]), int(batch.cu_seqlens_q_np[i + 1])
            if b - a > 1 and s.num_computed_tokens > 0:
                batch.positions[a:b] -= s.num_computed_tokens
                seen.setdefault("first", (s.request_id, a))
    _patch_build(monkeypatch, edit)
    toks, ids, wb, _ = run(sharp_llama_dir, prompts_with_shared_prefix())
    assert seen and toks != clean[0]
    found = errors(wb, "packing-positions")
    assert found and (found[0].request_id, found[0].evidence["token"]) == seen["first"]


# ---- 3. pool accounting -------------------------------------------------------------------
def test_abort_path_that_forgets_pages_is_a_leak_naming_the_request(sharp_llama_dir, monkeypatch):
    real = Scheduler.finish

    def finish(self, seq, reason):
        if reason == "abort":                    # the bug: drops the page list, frees nothing
            self.running.remove(seq)
            seq.pages = []
            seq.status = type(seq.status).FINISHED
            seq.finish_reason = reason
            return
        real(self, seq, reason)
    monkeypatch.setattr(Scheduler, "finish", finish)
    eng = engine(sharp_llama_dir)
    wb = Workbench(eng, log=False).attach(*PROBES)
    prompts = prompts_with_shared_prefix()[:3]
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    for _ in range(4):
        eng.step()
    victim = ids[1]
    eng.abort(victim)
    while eng.has_unfinished():
        eng.step()
    assert eng.pool.num_used > 0                        # pages really leaked
    leaks = errors(wb, "page-leak")
    assert leaks and leaks[0].request_id == victim and leaks[0].evidence["release_path"] == "abort"
    assert set(leaks[0].evidence["pages"]) <= {p for p in range(eng.pool.num_pages) if eng.pool.ref[p] > 0}


def test_preemption_that_forgets_a_page_is_a_leak(sharp_llama_dir, monkeypatch):
    def preempt(self, seq):
        seq.last_preemption = (len(seq.pages), seq.num_computed_tokens)
        self.kv.pool.free(reversed(seq.pages[1:]), seq.request_id)      # the bug: the first page is never freed
        seq.pages, seq.page_generations, seq.page_hashes = [], [], []
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        seq.status = type(seq.status).WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
    monkeypatch.setattr(Scheduler, "_preempt", preempt)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, n).tolist() for n in (40, 60, 50, 30)]
    _, ids, wb, eng = run(sharp_llama_dir, prompts, SamplingParams(max_tokens=30, ignore_eos=True),
                          num_pages=12, enable_prefix_caching=False)
    assert eng.stats()["num_preemptions"] > 0 and eng.pool.num_used > 0
    leaks = errors(wb, "page-leak")
    assert leaks and all(f.evidence["release_path"] == "preemption" for f in leaks)
    assert leaks[0].request_id in ids


def test_pool_books_recomputed_from_pages(sharp_llama_dir):
    # A free that forgets the counter: the flags and the queue say one thing, num_free another.
    eng = engine(sharp_llama_dir)
    wb = Workbench(eng, log=False).attach("pool_accounting")
    eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.pool.num_free -= 1
    row = wb.probe("pool_accounting").check()
    assert row["violations"] >= 1
    assert [f.kind for f in errors(wb)] == ["pool-counts"]


# ---- 4. prefix-cache hits -------------------------------------------------------------------
def test_registration_at_the_wrong_position_is_caught(sharp_llama_dir, clean, monkeypatch):
    # cache_full_pages registers each page under the key of the page before it (an index off
    # by one): a later request's page j is served from the page that holds the first's page j+1.
    def cache_full_pages(self, seq):
        num_full = min(seq.num_computed_tokens // self.page_size, len(seq.pages))
        hashes = seq.page_hashes
        if num_full <= len(hashes):
            return
        self.chain(seq, num_full - 1)
        memo = seq.hash_chain
        entered, idx = [], []
        for i in range(len(hashes), num_full):
            h, block = memo[i]
            hashes.append(h)
            if i >= 1:
                h0, b0 = memo[i - 1]
                if self.pool.register(seq.pages[i], h0, b0, i - 1, memo[i - 2][0] if i >= 2 else None):
                    entered.append(seq.pages[i])
                    idx.append(i - 1)
        if entered:
            self.pool.notify_registered(entered, idx, seq.request_id)
    monkeypatch.setattr(kvm.KVCacheManager, "cache_full_pages", cache_full_pages)
    toks, ids, wb, _ = run(sharp_llama_dir, prompts_with_shared_prefix())
    assert toks != clean[0]
    reg = errors(wb, "prefix-registration")
    assert reg and reg[0].request_id == ids[0]
    assert reg[0].evidence["claimed_index"] == reg[0].evidence["true_index"] - 1
    hit = errors(wb, "prefix-history")
    assert hit and hit[0].request_id in ids[1:4] and hit[0].evidence["computed_by"] == ids[0]


def test_chain_hash_without_parent_serves_a_page_at_the_wrong_position(sharp_llama_dir, monkeypatch):
    rng = np.random.default_rng(9)
    x, y = rng.integers(3, 256, 16).tolist(), rng.integers(3, 256, 20).tolist()
    prompts = [x + y, x + x + y]            # the second repeats page 0 as its page 1
    clean_toks, _, _, _ = run(sharp_llama_dir, prompts[:1] + prompts[1:])
    monkeypatch.setattr(kvm, "hash_chain", lambda parent, blocks: [(hash((0, b)), b) for b in blocks])
    eng = engine(sharp_llama_dir)
    wb = Workbench(eng, log=False).attach(*PROBES)
    a = eng.generate([prompts[0]], GREEDY)[0].token_ids
    b_out = eng.generate([prompts[1]], GREEDY)[0]
    assert [a, b_out.token_ids] != clean_toks and b_out.num_cached_tokens >= 32
    hit = errors(wb, "prefix-history")
    assert hit and hit[0].request_id == b_out.request_id and hit[0].evidence["page_index"] == 1
    assert hit[0].evidence["recorded_index"] == 0


def test_growth_one_page_short_is_caught(sharp_llama_dir, monkeypatch):
    # On one path (odd request ids here), grow() counts the pages it needs from the computed
    # tokens only, not the chunk: a decode that opens a new page runs one page short, reading
    # the table's padding for its newest token. (The widest row is a healthy request, so the
    # builder's own indexing does not trip over the short row.)
    real = kvm.KVCacheManager.grow

    def grow(self, seq, n):
        if seq.request_id % 2 == 0:
            return real(self, seq, n)
        need = kvm.pages_for(seq.num_computed_tokens, self.page_size) - len(seq.pages)
        if need > 0:
            new = self.pool.allocate(need, seq.request_id)
            seq.pages.extend(new)
            seq.page_generations.extend(self.pool.generation[p] for p in new)
        return True
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 256, 150).tolist()] + [rng.integers(3, 256, n).tolist() for n in (20, 40, 30)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] + [SamplingParams(max_tokens=20, ignore_eos=True)] * 3

    def go():
        eng = engine(sharp_llama_dir)
        wb = Workbench(eng, log=False).attach(*PROBES)
        return [o.token_ids for o in eng.generate(prompts, params)], wb
    clean_toks, _ = go()
    monkeypatch.setattr(kvm.KVCacheManager, "grow", grow)
    toks, wb = go()
    assert toks != clean_toks
    short = errors(wb, "page-list-short")
    assert short and short[0].request_id % 2 == 1
    assert short[0].evidence["pages_needed"] == short[0].evidence["pages_mapped"] + 1


# ---- the attention plan ---------------------------------------------------------------------
def test_plan_mask_that_sees_the_next_key_is_caught_every_step(sharp_llama_dir, clean, monkeypatch):
    from workbench.engine.attention.torch_ref import TorchPagedAttention
    real = TorchPagedAttention.plan

    def plan(self, batch, *a):
        p = real(self, batch, *a)
        for s in p.prefill:
            if s.mask is not None:             # a chunk after cached context: one key too many
                n, c = s.end - s.start, s.context
                s.mask = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None] + 1
        return p
    monkeypatch.setattr(TorchPagedAttention, "plan", plan)
    toks, ids, wb, _ = run(sharp_llama_dir, prompts_with_shared_prefix())
    assert toks != clean[0]
    found = [f for f in errors(wb, "packing-plan") if f.evidence["copy"] == "plan.prefill.mask"]
    assert found and found[0].request_id in ids[1:4]          # the requests that continue after a hit


def test_decode_plan_reading_another_rows_table_is_caught(sharp_llama_dir, clean, monkeypatch):
    from workbench.engine.attention.cpu_paged import CpuPagedAttention
    from workbench.engine.attention.torch_ref import TorchPagedAttention
    cls = CpuPagedAttention if isinstance(engine(sharp_llama_dir).attn, CpuPagedAttention) else TorchPagedAttention
    real = cls.plan_decode
    hit = {}

    def plan_decode(self, batch, rows_all, *a):
        groups, n = real(self, batch, rows_all, *a)
        g = groups[0] if groups else None
        if g is not None and hasattr(g, "rows") and len(g.rows) > 1:     # compiled kernel: a neighbour's row
            g.rows = g.rows.roll(1)
            hit["planted"] = True
        elif g is not None and hasattr(g, "width") and g.num_rows > 1:   # torch path: a neighbour's pages
            g.pages = g.pages.view(g.num_rows, -1).roll(1, 0).reshape(-1)
            hit["planted"] = True
        return groups, n
    monkeypatch.setattr(cls, "plan_decode", plan_decode)
    toks, ids, wb, _ = run(sharp_llama_dir, prompts_with_shared_prefix())
    assert hit and toks != clean[0]
    found = errors(wb, "packing-plan")
    assert found and found[0].request_id in ids
    assert found[0].evidence["copy"] in ("plan.decode.rows", "plan.decode.pages")


def test_compiled_prefill_reading_another_chunks_pages_is_caught(sharp_llama_dir, clean, monkeypatch):
    # The translation of plan.prefill into the compiled prefill kernel's inputs goes wrong: a
    # chunk that continues after a prefix hit gets another chunk's table row. plan.prefill is
    # still right, so only a check of what the kernel walks sees it.
    from workbench.engine.attention.cpu_paged import CpuPagedAttention
    if not isinstance(engine(sharp_llama_dir).attn, CpuPagedAttention):
        pytest.skip("the compiled CPU attention is not built here")
    real = CpuPagedAttention.plan
    planted = []

    def plan(self, batch, *a, **kw):
        p = real(self, batch, *a, **kw)
        npf = p.native_prefill
        paged = [] if npf is None else [k for k, c in enumerate(npf.chunks.tolist()) if not c[4]]
        if len(paged) >= 2:                                   # two chunks read pages: swap their rows
            a0, b0 = paged[0], paged[1]
            npf.chunks[a0, 3], npf.chunks[b0, 3] = int(npf.chunks[b0, 3]), int(npf.chunks[a0, 3])
            starts = batch.cu_seqlens_q.tolist()
            planted.append({batch.seqs[starts.index(int(npf.chunks[k, 0]))].request_id for k in (a0, b0)})
        elif paged:                                           # one: its first page becomes the last one's
            k = paged[0]
            row = int(npf.chunks[k, 3])
            n = int(npf.chunks[k, 2] + 15) // 16
            if n > 1:
                npf.tables[row, 0] = npf.tables[row, n - 1]
                starts = batch.cu_seqlens_q.tolist()
                planted.append({batch.seqs[starts.index(int(npf.chunks[k, 0]))].request_id})
        return p
    monkeypatch.setattr(CpuPagedAttention, "plan", plan)
    toks, ids, wb, _ = run(sharp_llama_dir, prompts_with_shared_prefix())
    assert planted, "no step had a compiled prefill chunk reading pages"
    assert toks != clean[0]
    found = [f for f in errors(wb, "packing-plan") if f.evidence["copy"] == "plan.native_prefill.tables"]
    assert found and found[0].request_id in planted[0]
