"""page_table: the block table the kernels read, checked against the pool that owns the pages.

Per forward (vectorised numpy over the [B, W] table, read once at layer 0 through a
model-hook tap, before any page is read), on the bytes of the bound device table the
kernels read (not its version stamp):
- ground truth: every row, over the columns its context reads, equals the page list of
  the sequence in that batch position (rebuilt from the sequences, probes/packing.py);
  a mismatch names the request, row, column, the page read and the page meant, the crc
  of the bytes read and whether the staged host rows or the bind went wrong;
- page ids outside [0, num_pages) (kernels do not validate them);
- all-zero rows for sequences that map non-zero pages (vllm #7003);
- stale binding, the cheap first signal: the version of the bound table the kernels read (after
  the first and the last layer's attention, through the same tap: an old table bound between
  them shows at the last) is not the one current for the step;
- the tables a backend hands its kernels when they are not the bound table itself (the NPU
  ops of a mixed step each get their rows: plan.op_tables()), row by row against the pages.
On every freed page (PagesFreed): a page freed while a live sequence still maps it.
Every `every` steps (StepFinished), a scan of the live page tables against the pool:
- pages mapped by a live sequence but free in the pool;
- refcount != the number of live page tables mapping the page;
- a page reused under a live sequence: its generation changed since the sequence got it.

Cost: both checks are compiled where a C compiler is at hand (page_table_native.py), and their
numpy code below runs only where the compiled pass finds something off, to name each finding.
The per-forward check reads B*W int32 ids (a device sync off CPU) and makes one pass over them:
~0.17 ms a forward on SmolLM2's workload A, the host copy and the reference it shares with packing
included (numpy's passes: ~0.25 ms). The scan is O(num_pages + mapped pages), one pass over the
live page lists and one over the pool's arrays: ~50 us a step (numpy's ~30 small operations right
after the sampler: ~270 us); raise `every` for large pools.
"""
from __future__ import annotations

import time
import zlib
from itertools import chain
from typing import Any

import numpy as np

from workbench.engine import instrumentation
from workbench.engine.taps import ModelTap
from workbench.events import PagesFreed, StepFinished
from workbench.probe import Probe

from . import invariants, page_table_native
from .packing import batch_reference, record_for

HINT_RANGE = ("kernels (Ascend paged attention, flash_attn_with_kvcache) do not validate block ids: find "
              "who wrote this row (a table sized for another pool, an unmasked padding id, an id from "
              "another card's pool) and check ids in [0, num_pages) at bind time in debug builds")
HINT_ZERO = ("a live sequence's row was all zeros, so the kernel read page 0 for all its context (vllm "
             "#7003, mixed cached/non-cached batch): fill every row of the block table for every batch")
HINT_STALE = ("bind the block tables before the kernel launch (BatchBuilder.build(bind=True), "
              "BlockTables.bind() before model.forward); assert not BlockTables.is_stale at launch")
HINT_MISMATCH = ("the kernel reads pages other than the ones the request maps: check BlockTables.fill_host (rows "
                 "in batch order, from each sequence's own page list) and bind() (the staged bytes, all rows, "
                 "before the launch); the crc of the bytes read is in the evidence")
HINT_SHORT = ("pages are allocated for the tokens computed in the step (KVCacheManager.grow / try_admit): "
              "pages_for(computed + chunk) pages must be mapped before the forward")
HINT_FREED = ("a page was freed while a live sequence still maps it: a missing or dropped refcount "
              "(prefix sharing); PagePool.free must free only at ref 0 and every sharer must acquire")
HINT_REF = ("refcount must equal the number of live page tables that map the page: look for a release "
            "path that does not decrement, or a share that does not acquire")
HINT_REUSED = ("the page was handed out again while this request still reads it: its KV now belongs to "
               "another request (garbage on prefix-cache hits); fix the refcount on the free path")

MAX_PER_CHECK = 8          # findings one check may add (a broken table can have thousands of bad ids)


class _ReadTap(ModelTap):
    """The table check before layer 0's attention; the version read after the first and the last
    layer's attention. Called at those two layers only (forward_layers)."""
    needs = frozenset({"kv", "attention_out"})

    def __init__(self, check_table, read):
        self.check_table, self.read = check_table, read
        self.last = 0

    def forward_layers(self, batch):
        return (0, self.last)

    def on_kv(self, layer, k, v, batch) -> None:
        if layer == 0:
            self.check_table(batch)

    def on_attention_out(self, layer, o, batch) -> None:
        self.read(layer)


class PageTableProbe(Probe):
    name = "page_table"
    description = "block-table bounds, stale binding, zero rows; pool scan: free-while-mapped, refcount, reuse"

    def __init__(self, every: int = 1, max_rows: int = 100_000, **params: Any):
        super().__init__(every=every, max_rows=max_rows, **params)
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        self.every, self.max_rows = every, max_rows
        self._tap = _ReadTap(self.guard(self.check_table), self.guard(self._on_attention))
        self._batch = None           # the batch of the forward in flight, and the table it reads
        self._read: np.ndarray | None = None
        self._stale_step = None
        self.tables_checked = 0
        self.scans = 0

    # ---- wiring ------------------------------------------------------------
    def on_attach(self, engine) -> None:
        self.listen(PagesFreed, self.on_freed)
        self.listen(StepFinished, self.on_step)
        self._tap.last = engine.model_config.num_layers - 1
        instrumentation.add_tap(engine, self._tap)

    def on_detach(self, engine) -> None:
        instrumentation.remove_tap(engine, self._tap)
        self._batch = self._read = None

    def _row(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) > self.max_rows:          # a probe must not become the leak it hunts
            del self.rows[: len(self.rows) // 2]

    # ---- per forward: the table the kernel reads -------------------------------
    def check_table(self, batch) -> None:
        step = self.engine.step_count
        n = self.engine.pool.num_pages
        raw = batch.block_tables.detach().to("cpu").contiguous()
        a = raw.numpy().astype(np.int64)                 # a copy: the buffer is rewritten next bind
        self._batch, self._read = batch, a
        self.tables_checked += 1
        if a.size == 0:
            return
        if page_table_native.table(a, record_for(self.engine, batch), n):   # compiled: nothing below would find anything
            self.check_op_tables(batch, None, a, n, step)
            return
        ref, _ = batch_reference(self.engine, batch)
        need = ref.need                                   # pages each row maps, from the sequences' state
        width = min(a.shape[1], ref.table.shape[1]) if a.ndim == 2 and a.shape[0] == len(need) else 0
        cols = np.zeros_like(a, dtype=bool)
        if width:
            cols[:, :width] = np.arange(width)[None, :] < need[:, None]
        bad = ((a < 0) | (a >= n)) & cols
        if bad.any():
            for r, c in np.argwhere(bad)[:MAX_PER_CHECK]:
                seq = batch.seqs[r]
                pid = int(a[r, c])
                meant = seq.pages[c] if c < len(seq.pages) else None
                self.report(
                    "critical", f"request {seq.request_id}: block table row {r}, column {c} holds page {pid}, "
                                f"outside the pool [0, {n}) (the page table says {meant})",
                    hint=HINT_RANGE, kind="page-out-of-range", dedup=("page-out-of-range", seq.request_id, pid),
                    step=step, request_id=seq.request_id, page=pid,
                    evidence={"row": int(r), "column": int(c), "page_read": pid, "page_meant": meant,
                              "num_pages": n, "table_rows": int(a.shape[0]), "table_width": int(a.shape[1])})
        # A row that reads its context from pages (not a whole-prompt prefill) but holds only zeros.
        reads = ref.context_lens > ref.q_lens
        zero = reads & ~((a != 0) & cols).any(axis=1) if width else np.zeros(0, dtype=bool)
        zero_rows = set()
        for r in np.nonzero(zero)[0][:MAX_PER_CHECK]:
            seq = batch.seqs[r]
            meant = seq.pages[: int(need[r])]
            if any(p != 0 for p in meant):
                zero_rows.add(int(r))
                self.report(
                    "error", f"request {seq.request_id}: its block table row is all zeros, it maps pages "
                             f"{meant[:8]}", hint=HINT_ZERO, kind="zero-row",
                    dedup=("zero-row", seq.request_id), step=step, request_id=seq.request_id,
                    page=int(next(p for p in meant if p != 0)),
                    evidence={"row": int(r), "pages_meant": list(meant[:64]),
                              "context_len": int(ref.context_lens[r])})
        # A page list shorter than the context it must cover: the kernel reads a page the
        # sequence does not own (padding or another request's) for its last tokens.
        for r in np.nonzero(ref.short)[0][:MAX_PER_CHECK]:
            seq = batch.seqs[r]
            self.report(
                "error", f"request {seq.request_id}: {int(ref.context_lens[r])} tokens of context need "
                         f"{int(need[r])} pages, its page list holds {len(seq.pages)}: the kernel reads pages it "
                         f"does not own for positions from {len(seq.pages) * batch.page_size}",
                hint=HINT_SHORT, kind="page-list-short", dedup=("page-list-short", seq.request_id, int(need[r])),
                step=step, request_id=seq.request_id,
                evidence={"row": int(r), "pages_needed": int(need[r]), "pages_mapped": len(seq.pages),
                          "context_len": int(ref.context_lens[r]), "computed_before": int(ref.starts[r]),
                          "chunk": int(ref.q_lens[r])})
        # Ground truth: the bytes the kernel reads, row by row, against each sequence's page list.
        wrong = [m for m in invariants.compare_table(a, ref, "block_tables", num_pages=n) if m.row not in zero_rows]
        if wrong:
            self._report_mismatch(batch, ref, a, raw, wrong, step)
        self.check_op_tables(batch, ref, a, n, step)

    def check_op_tables(self, batch, ref, bound: np.ndarray, n: int, step: int) -> None:
        """Backends whose kernels get tables of their own (the NPU ops: a mixed step hands each call
        its rows, index_select copies) say so in their plan (op_tables()); each table as passed is
        checked row by row against the page list of the sequence in that batch row. A row equal to
        the bound table's was judged above; what is reported here is where the call's copy differs."""
        plan = getattr(batch, "attn_plan", None)
        tables = plan.op_tables() if hasattr(plan, "op_tables") else ()
        if tables and ref is None:                    # the bound table was judged clean without one
            ref, _ = batch_reference(self.engine, batch)
        for op, t, rows in tables:
            if t is batch.block_tables:
                continue                                  # the bound table itself: checked above
            got = t.detach().to("cpu").numpy().astype(np.int64)
            rows = np.asarray(rows, dtype=np.int64)
            if got.ndim != 2 or got.shape[0] != len(rows):
                self.report("error", f"{op} is given a block table of shape {tuple(got.shape)} for {len(rows)} rows",
                            hint=HINT_MISMATCH, kind="op-table-shape", dedup=("op-table-shape", op), step=step,
                            evidence={"op": op, "shape": list(got.shape), "rows": rows[:64].tolist()})
                continue
            found = 0
            for k, r in enumerate(rows.tolist()):
                if not 0 <= r < len(ref.need) or ref.short[r]:
                    continue
                w = min(int(ref.need[r]), got.shape[1])
                bad = np.nonzero(got[k, :w] != ref.table[r, :w])[0]
                if not len(bad) or (r < bound.shape[0] and w <= bound.shape[1]
                                    and np.array_equal(got[k, :w], bound[r, :w])):
                    continue
                c = int(bad[0])
                seq, pid, meant = batch.seqs[r], int(got[k, c]), int(ref.table[r, c])
                outside = not 0 <= pid < n
                self.report(
                    "critical" if outside else "error",
                    f"request {seq.request_id}: {op} reads page {pid} at column {c} (its row {k}, batch row {r}); "
                    f"the request maps page {meant} there" + (f" (outside the pool [0, {n}))" if outside else ""),
                    hint=HINT_RANGE if outside else HINT_MISMATCH,
                    kind="page-out-of-range" if outside else "op-table-mismatch",
                    dedup=("op-table", op, seq.request_id, pid), step=step, request_id=seq.request_id, page=pid,
                    evidence={"op": op, "op_row": k, "row": r, "column": c, "page_read": pid, "page_meant": meant,
                              "columns_wrong": bad[:16].tolist(), "num_pages": n})
                found += 1
                if found >= MAX_PER_CHECK:
                    break

    def _report_mismatch(self, batch, ref, a: np.ndarray, raw, wrong: list, step: int) -> None:
        bt = self.engine.builder.block_tables
        crc_read = zlib.crc32(raw.numpy().tobytes())
        crc_meant = zlib.crc32(ref.table.astype(np.int32).tobytes())
        host = bt.host_view() if hasattr(bt, "host_view") else None
        same_shape = host is not None and host.shape == a.shape
        host_ok = same_shape and bool((host.astype(np.int64)[:, : ref.table.shape[1]] == ref.table).all()
                                      if host.shape[1] >= ref.table.shape[1] else False)
        dev_is_host = same_shape and bool((host == a).all())
        if host_ok and not dev_is_host:
            cause = ("the host staging rows are right, the device buffer the kernel reads is not: the bind "
                     "published other bytes than the staged ones" + (" while stamping them current"
                                                                    if bt.version == bt.host_version else ""))
        elif not host_ok and dev_is_host:
            cause = ("the staged host rows are already wrong (the bind copied them faithfully): the table was "
                     "filled from other page lists or in another order than the batch's sequences")
        else:
            cause = "neither the staged host rows nor the device buffer match the sequences' page lists"
        ev_common = {"crc_read": crc_read, "crc_meant": crc_meant, "version_read": bt.version,
                     "version_current": bt.host_version, "host_rows_match": host_ok,
                     "device_equals_host": dev_is_host, "cause": cause}
        for m in wrong[:MAX_PER_CHECK]:
            if m.row < 0:
                self.report("error", f"the bound block table has {m.got} rows, the batch has {m.want} sequences",
                            hint=HINT_MISMATCH, kind="block-table-mismatch", step=step,
                            dedup=("block-table-shape", step), evidence={**ev_common})
                continue
            seq = batch.seqs[m.row]
            need = int(ref.need[m.row])
            self.report(
                "error", f"request {seq.request_id}: the block table the kernel reads has page {m.got} at row "
                         f"{m.row}, column {m.index}; the request's page list says {m.want} ({cause})",
                hint=HINT_MISMATCH, kind="block-table-mismatch",
                dedup=("block-table-mismatch", seq.request_id, m.index, m.got), step=step,
                request_id=seq.request_id, page=m.want,
                evidence={**ev_common, "row": m.row, "column": m.index, "page_read": m.got, "page_meant": m.want,
                          "row_read": a[m.row, :need].tolist()[:64], "row_meant": ref.table[m.row, :need].tolist()[:64]})

    # ---- the version the kernels read --------------------------------------------
    def _on_attention(self, layer: int) -> None:
        """After the first and the last layer's attention: the bound table's version, as the kernels
        read it (the hooks' AttentionRead says the same for every layer, to the event log)."""
        bt = self.engine.builder.block_tables
        step, version = self.engine.step_count, bt.version
        if version == bt.host_version or self._stale_step == step:
            return
        self._stale_step = step             # every layer reads the same table: one check per step
        ev = {"version_read": version, "version_current": bt.host_version,
              "checksum_read": bt.checksum, "checksum_current": bt.host_checksum, "layer": layer}
        batch, a = self._batch, self._read
        if batch is None or a is None:
            self.report("error", f"the kernel read block-table version {version}, "
                                 f"{bt.host_version} is current", hint=HINT_STALE, kind="stale-binding",
                        dedup=("stale-binding", step), step=step, evidence=ev)
            return
        ev["batch_version"] = batch.block_tables_version
        # The table the sequences mean: the reference check_table built for this batch, padded to
        # the width read.
        ref, _ = batch_reference(self.engine, batch)
        need = ref.need
        meant = np.zeros_like(a)
        w = min(a.shape[1], ref.table.shape[1])
        meant[:, :w] = ref.table[:, :w]
        cols = np.arange(a.shape[1])[None, :] < need[:, None]
        reads = ref.context_lens > ref.q_lens
        wrong = (a != meant) & cols & reads[:, None]
        ev["checksum_rows_read"] = zlib.crc32(a.astype(np.int32).tobytes())
        ev["checksum_rows_meant"] = zlib.crc32(meant.astype(np.int32).tobytes())
        rows = np.nonzero(wrong.any(axis=1))[0]
        if len(rows) == 0:
            self.report("warn", f"the kernel read block-table version {version} while "
                                f"{bt.host_version} is current; the rows it read still match the page table, "
                                f"so this step is right by luck", hint=HINT_STALE, kind="stale-binding",
                        dedup=("stale-binding-latent",), step=step, evidence=ev)
            return
        for r in rows[:MAX_PER_CHECK]:
            c = int(np.nonzero(wrong[r])[0][0])
            seq = batch.seqs[r]
            got, want = int(a[r, c]), int(meant[r, c])
            self.report(
                "error", f"request {seq.request_id}: the kernel read block-table version "
                         f"{version}, {bt.host_version} is current; column {c} read page {got}, "
                         f"the page table says {want}", hint=HINT_STALE, kind="stale-binding",
                dedup=("stale-binding", seq.request_id, want), step=step, request_id=seq.request_id,
                page=want, evidence={**ev, "row": int(r), "column": c, "page_read": got, "page_meant": want,
                                     "row_read": a[r, : int(need[r])].tolist(),
                                     "row_meant": meant[r, : int(need[r])].tolist()})

    # ---- pool events ---------------------------------------------------------------
    def on_freed(self, e: PagesFreed) -> None:
        freed = set(e.pages)
        hits = 0
        for s in self.engine.live_sequences():
            for j, p in enumerate(s.pages):
                if p in freed and hits < MAX_PER_CHECK:
                    hits += 1
                    self._report_free_while_mapped(s, j, p, e.step, "freed")

    def _report_free_while_mapped(self, seq, j: int, p: int, step: int, how: str) -> None:
        self.report(
            "error", f"request {seq.request_id}: page {p} (its page {j}) was {how} while the request still "
                     f"maps it", hint=HINT_FREED, kind="free-while-mapped",
            dedup=("free-while-mapped", seq.request_id, p), step=step, request_id=seq.request_id, page=p,
            evidence={"page_index": j, "refcount": self.engine.pool.ref[p], "pages": list(seq.pages[:64])})

    # ---- every `every` steps: live page tables against the pool ---------------------
    def on_step(self, e: StepFinished) -> None:
        if e.step % self.every == 0:
            self.scan(e.step)

    def scan(self, step: int | None = None) -> dict:
        """Check every live page table against the pool now; returns the counts (also a frame() row)."""
        t0 = time.perf_counter_ns()
        eng = self.engine
        step = eng.step_count if step is None else step
        pool = eng.pool
        n = pool.num_pages
        live = [s for s in eng.live_sequences() if s.pages]
        fq = pool.free_queue()
        clean = page_table_native.scan([s.pages for s in live], [s.page_generations for s in live], pool.ref,
                                       pool.generation, fq.is_free)
        if clean is not None:           # the compiled scan found nothing off: the row, no numpy pass
            return self._scanned(step, t0, len(live), *clean)
        lens = np.fromiter((len(s.pages) for s in live), np.int64, len(live))
        pages = np.fromiter(chain.from_iterable(s.pages for s in live), np.int64, int(lens.sum()))
        owner = np.repeat(np.arange(len(live)), lens)
        inside = (pages >= 0) & (pages < n)
        ref = np.asarray(pool.ref, dtype=np.int64)
        gen = np.asarray(pool.generation, dtype=np.int64)
        counts = np.bincount(pages[inside], minlength=n)
        budget = [MAX_PER_CHECK]

        def report(*a, **kw):
            if budget[0] > 0 and self.report(*a, **kw) is not None:
                budget[0] -= 1

        for k in np.nonzero(~inside)[0][:MAX_PER_CHECK]:
            s, p = live[owner[k]], int(pages[k])
            report("critical", f"request {s.request_id}: its page table holds page {p}, outside the pool [0, {n})",
                   hint=HINT_RANGE, kind="page-out-of-range", dedup=("page-out-of-range", s.request_id, p),
                   step=step, request_id=s.request_id, page=p, evidence={"num_pages": n})
        # Mapped but free (the pool's per-page free flags, read as an array: no call per mapped page).
        is_free = np.asarray(fq.is_free, dtype=bool)        # as pool_accounting reads them
        at = np.nonzero(inside)[0]
        mapped_free = at[is_free[pages[at]]].tolist()
        for k in mapped_free[:MAX_PER_CHECK]:
            s = live[owner[k]]
            j = int(k - np.searchsorted(owner, owner[k]))
            if budget[0] > 0:
                budget[0] -= 1
                self._report_free_while_mapped(s, j, int(pages[k]), step, "found free in the pool")
        # Reused under a live sequence: the generation moved since the sequence took the page.
        gens_ok = all(len(s.page_generations) == len(s.pages) for s in live)
        reused = np.zeros(0, dtype=np.int64)
        if gens_ok and len(pages):
            had = np.fromiter(chain.from_iterable(s.page_generations for s in live), np.int64, len(pages))
            now = np.where(inside, gen[np.where(inside, pages, 0)], had)
            reused = np.nonzero(now != had)[0]
            for k in reused[:MAX_PER_CHECK]:
                s, p = live[owner[k]], int(pages[k])
                j = int(k - np.searchsorted(owner, owner[k]))
                report("error", f"request {s.request_id}: page {p} (its page {j}) was handed out again while "
                                f"the request still maps it (generation {had[k]} -> {now[k]}); it now reads "
                                f"another request's KV", hint=HINT_REUSED, kind="page-reused",
                       dedup=("page-reused", s.request_id, p, int(now[k])), step=step, request_id=s.request_id,
                       page=p, evidence={"page_index": j, "generation_mapped": int(had[k]),
                                         "generation_now": int(now[k]), "refcount": int(ref[p])})
        # Refcount vs the number of live tables mapping the page.
        missing = np.nonzero(counts > ref)[0]
        leaked = np.nonzero(counts < ref)[0]
        for p in missing[:MAX_PER_CHECK]:
            users = [live[o].request_id for o in np.unique(owner[pages == p])]
            report("error", f"page {p}: refcount {ref[p]} but live page tables map it {counts[p]} times "
                            f"(requests {users[:8]}): a reference is missing", hint=HINT_REF, kind="refcount",
                   dedup=("refcount", int(p), int(counts[p]), int(ref[p])), step=step,
                   request_id=users[0] if users else None, page=int(p),
                   evidence={"refcount": int(ref[p]), "mapped_by": int(counts[p]), "requests": users[:64]})
        for p in leaked[:MAX_PER_CHECK]:
            report("warn", f"page {p}: refcount {ref[p]} but live page tables map it only {counts[p]} times: "
                           f"a leaked reference (the page never returns to the pool)", hint=HINT_REF,
                   kind="refcount", dedup=("refcount", int(p), int(counts[p]), int(ref[p])), step=step,
                   page=int(p), evidence={"refcount": int(ref[p]), "mapped_by": int(counts[p])})
        return self._scanned(step, t0, len(live), int(len(pages)), int((counts > 1).sum()),
                             out_of_range=int((~inside).sum()), free_while_mapped=len(mapped_free),
                             reused=int(len(reused)), refcount_missing=int(len(missing)),
                             refcount_leaked=int(len(leaked)))

    def _scanned(self, step: int, t0: int, live: int, mapped: int, shared: int, out_of_range: int = 0,
                 free_while_mapped: int = 0, reused: int = 0, refcount_missing: int = 0,
                 refcount_leaked: int = 0) -> dict:
        """A scan's frame() row, kept and returned (the compiled scan's and the numpy one's alike)."""
        self.scans += 1
        row = {"step": step, "live_seqs": live, "mapped_pages": mapped, "shared_pages": shared,
               "free_pages": self.engine.pool.num_free, "out_of_range": out_of_range,
               "free_while_mapped": free_while_mapped, "reused": reused, "refcount_missing": refcount_missing,
               "refcount_leaked": refcount_leaked, "scan_us": (time.perf_counter_ns() - t0) / 1e3}
        self._row(row)
        return row
