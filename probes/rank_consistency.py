"""rank_consistency: every rank of a tensor-parallel engine binds the same page table (field note 9).

Two cards, card 0 right, card 1 garbage: each card kept its own host copy of the page table
and they drifted. With tensor parallelism every rank holds the same page ids (only the
heads differ), so every rank's bound block table, slot mapping and live-page accounting
must be the same bytes. After every forward, each rank computes a digest of its own state,
read where its kernels read it, by this module's own function (rank_digest, run on every
rank through the driver's per-step taps; one all-gather of 9 int64 per rank):

    crc32 of the bound block table bytes (the device buffer), its rows, width and version,
    crc32 of the slot mapping, the pool's free count (pages no live page list maps) and a
    crc32 of the refcounts, crc32 of the request ids in batch order

Rank 0 is the driver, whose table is the engine's own (built from the sequences' page
lists). A rank whose digest differs is explained at once: the probe fetches the rows from
every rank (rank_rows, rank_pages, rank_refs through Driver.call) and names the rank, the
request, the row, the columns and the pages that differ, and that rank's own page list for
the request. Silent on one device (nothing to compare) and on a clean tensor-parallel run.

Cost: the digest (a few crc32 over B*W int32, T int64 and num_pages int64 per rank) and
one all-gather of 72 bytes per rank, per forward; the fetches only on a mismatch.
"""
from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from workbench.probe import Probe

DIGEST = ("table_crc", "rows", "width", "version", "slot_crc", "tokens", "free_pages", "ref_crc", "rids_crc")
MAX_PER_CHECK = 8
HINT = ("one source of truth for the page table: every rank binds the driver's table bytes, broadcast with the "
        "step's plan and crc-checked before the launch (the engine's default, table_source='broadcast'); a rank "
        "that builds its table from its own host copy, kept by update messages, drifts when an update is lost")
HINT_POOL = ("the rank's account of live pages differs from the driver's pool: it missed page-table updates "
             "(admissions, growth, releases) for the requests named; resync it (Driver.resync) after the fix")


def _crc(a) -> int:
    return zlib.crc32(np.ascontiguousarray(a).tobytes())


def _np(t):
    return t.detach().to("cpu").contiguous().numpy()


def _table(view) -> np.ndarray:
    bt = view.block_tables
    b, w = bt.shape
    return _np(bt.view((b, w))) if b else np.zeros((0, 0), dtype=np.int32)


def _slots(view) -> np.ndarray:
    return _np(view.batch.slot_mapping) if view.batch is not None else np.zeros(0, dtype=np.int64)


# ---- run on every rank (each over its own RankView) -------------------------------------------
def rank_digest(view) -> list[int]:
    """This rank's digest, read from its own bound buffer, slot mapping and page accounting."""
    table, slots = _table(view), _slots(view)
    ref = np.asarray(view.ref, dtype=np.int64)
    b, w = view.block_tables.shape
    return [_crc(table), b, w, int(view.block_tables.version), _crc(slots), len(slots), int((ref == 0).sum()),
            _crc(ref), _crc(np.asarray(view.request_ids, dtype=np.int64))]


def rank_rows(view) -> np.ndarray:
    """[B, W, table (B*W), request ids (B), T, slot mapping (T), host-copy binding (0/1)]."""
    table, slots = _table(view), _slots(view)
    b, w = table.shape if table.ndim == 2 else (0, 0)
    return np.concatenate([[b, w], table.reshape(-1).astype(np.int64), np.asarray(view.request_ids, np.int64),
                           [len(slots)], slots.astype(np.int64), [int(view.table_source == "host_copy")]])


def rank_pages(view, request_ids=()) -> np.ndarray:
    """[rid, n, pages...] per request: this rank's own page list for it (n = -1: it has none)."""
    out: list[int] = []
    for rid in request_ids:
        pages = view.page_lists.get(int(rid))
        out += [int(rid), -1] if pages is None else [int(rid), len(pages), *map(int, pages)]
    return np.asarray(out, dtype=np.int64)


def rank_refs(view) -> np.ndarray:
    return np.asarray(view.ref, dtype=np.int64)


def _split_rows(v: np.ndarray) -> dict:
    b, w = int(v[0]), int(v[1])
    o = 2
    table = v[o:o + b * w].reshape(b, w)
    o += b * w
    rids = v[o:o + b]
    o += b
    t = int(v[o])
    slots = v[o + 1:o + 1 + t]
    return {"table": table, "rids": rids, "slots": slots, "host_copy": bool(v[o + 1 + t]) if len(v) > o + 1 + t else False}


def _page_lists(v: np.ndarray) -> dict:
    out, i, u = {}, 0, v.tolist()
    while i < len(u):
        rid, n = u[i], u[i + 1]
        out[rid] = None if n < 0 else u[i + 2:i + 2 + n]
        i += 2 + max(n, 0)
    return out


class RankConsistencyProbe(Probe):
    name = "rank_consistency"
    description = "every rank binds the same block table, slot mapping and page accounting (tensor parallel)"

    def __init__(self, max_rows: int = 100_000, **params: Any):
        super().__init__(max_rows=max_rows, **params)
        self.max_rows = max_rows
        self.par = None
        self.checks = 0
        self.mismatched_steps = 0

    def on_attach(self, engine) -> None:
        self.par = getattr(engine, "parallel", None)
        if self.par is None:
            return                                   # one device: nothing to compare
        self.par.add_tap(self.name, f"{__name__}:rank_digest", len(DIGEST), self.guard(self.on_digests))

    def on_detach(self, engine) -> None:
        if self.par is not None:
            try:
                self.par.remove_tap(self.name)
            except Exception:                        # noqa: BLE001 - a broken group has no taps left to remove
                pass
        self.par = None

    # ---- every forward ---------------------------------------------------------------------
    def on_digests(self, step: int, d: np.ndarray, exchange_ns: int) -> None:
        self.cost_ns += exchange_ns                  # the digest and the all-gather ran for this probe
        self.checks += 1
        failed = [r for r in range(d.shape[0]) if (d[r] == -1).all()]
        if failed:                                   # a rank's digest raised there: a probe error, not a desync
            raise RuntimeError(f"the digest failed on ranks {failed} at step {step} (error/tap/<rank> in the store)")
        ref = d[0]
        differ = [r for r in range(1, d.shape[0]) if (d[r] != ref).any()]
        row = {"step": step, "ranks": int(d.shape[0]), "agree": not differ, "differing_ranks": tuple(differ),
               "exchange_us": exchange_ns / 1e3}
        for r in range(d.shape[0]):
            row[f"table_crc_{r}"] = int(d[r, 0])
            row[f"free_pages_{r}"] = int(d[r, 6])
        self.rows.append(row)
        if len(self.rows) > self.max_rows:
            del self.rows[: len(self.rows) // 2]
        if differ:
            self.mismatched_steps += 1
            self._explain(step, d, differ)

    def _explain(self, step: int, d: np.ndarray, differ: list[int]) -> None:
        col = {n: i for i, n in enumerate(DIGEST)}
        fetched = [_split_rows(v) for v in self.par.call(f"{__name__}:rank_rows")]
        mine = fetched[0]
        budget = MAX_PER_CHECK
        for r in differ:
            got = fetched[r]
            digest = {n: (int(d[0, i]), int(d[r, i])) for n, i in col.items() if d[0, i] != d[r, i]}
            ev0 = {"rank": r, "digest_driver": dict(zip(DIGEST, map(int, d[0]))),
                   "digest_rank": dict(zip(DIGEST, map(int, d[r]))), "differs": sorted(digest),
                   "binds_host_copy": got["host_copy"]}
            table_bad = any(k in digest for k in ("table_crc", "rows", "width", "rids_crc"))
            if table_bad:
                budget = self._rows_differ(step, r, mine, got, ev0, budget)
            elif "slot_crc" in digest or "tokens" in digest:
                s0, s1 = mine["slots"], got["slots"]
                n = min(len(s0), len(s1))
                toks = np.nonzero(s0[:n] != s1[:n])[0][:16].tolist()
                self.report("error", f"rank {r}: the slot mapping differs from rank 0's at tokens {toks} (same "
                                     f"block table): its K/V lands in other slots", hint=HINT, kind="rank-slot-mapping",
                            dedup=("rank-slot-mapping", r, step), step=step,
                            evidence={**ev0, "tokens": toks, "slots_rank": s1[toks].tolist() if toks else [],
                                      "slots_driver": s0[toks].tolist() if toks else []})
            elif "version" in digest:
                self.report("warn", f"rank {r}: bound block-table version {digest['version'][1]}, rank 0 "
                                    f"{digest['version'][0]}: a rank skipped or repeated a bind (same bytes this step)",
                            hint=HINT, kind="rank-table-version", dedup=("rank-table-version", r), step=step,
                            evidence=ev0)
            if "free_pages" in digest or "ref_crc" in digest:
                self._pool_differs(step, r, ev0)

    def _rows_differ(self, step, r, mine, got, ev0, budget) -> int:
        t0, t1 = mine["table"], got["table"]
        rids0, rids1 = mine["rids"], got["rids"]
        if t0.shape[0] != t1.shape[0] or not np.array_equal(rids0, rids1):
            self.report("error", f"rank {r}: its bound block table holds {t1.shape[0]} rows for requests "
                                 f"{rids1.tolist()[:16]}, rank 0's {t0.shape[0]} for {rids0.tolist()[:16]}",
                        hint=HINT, kind="rank-desync", dedup=("rank-rows", r, step), step=step,
                        evidence={**ev0, "request_ids_rank": rids1.tolist(), "request_ids_driver": rids0.tolist()})
            return budget - 1
        w = max(t0.shape[1], t1.shape[1])
        a = np.zeros((t0.shape[0], w), np.int64)
        b = np.zeros_like(a)
        a[:, :t0.shape[1]], b[:, :t1.shape[1]] = t0, t1
        bad_rows = np.nonzero((a != b).any(axis=1))[0][:budget]
        own = _page_lists(self.par.call(f"{__name__}:rank_pages", request_ids=[int(rids0[i]) for i in bad_rows])[r]) \
            if len(bad_rows) else {}
        eng = self.engine
        for i in bad_rows:
            rid = int(rids0[i])
            cols = np.nonzero(a[i] != b[i])[0]
            p0, p1 = a[i, cols].tolist(), b[i, cols].tolist()
            seq = next((s for s in eng.live_sequences() if s.request_id == rid), None)
            meant = list(seq.pages) if seq is not None else None
            self.report(
                "error", f"rank {r}: request {rid} (row {int(i)}) reads pages {p1[:8]} at columns {cols.tolist()[:8]} of "
                         f"its bound block table; rank 0's table (the driver's, from the request's page list) has "
                         f"{p0[:8]} there" + (f"; rank {r}'s own page list for it: {own.get(rid)}"
                                               if got["host_copy"] else ""),
                hint=HINT, kind="rank-desync", dedup=("rank-desync", r, rid), step=step, request_id=rid,
                page=int(p0[0]) if p0 else None,
                evidence={**ev0, "row": int(i), "columns": cols.tolist(), "pages_rank": p1, "pages_driver": p0,
                          "pages": sorted(set(p0) | set(p1)), "row_rank": b[i].tolist(), "row_driver": a[i].tolist(),
                          "page_list_rank": own.get(rid), "page_list_driver": meant})
            budget -= 1
        return budget

    def _pool_differs(self, step, r, ev0) -> None:
        refs = self.par.call(f"{__name__}:rank_refs")
        r0, r1 = refs[0], refs[r]
        n = min(len(r0), len(r1))
        pages = np.nonzero(r0[:n] != r1[:n])[0]
        holders = {}
        for s in self.engine.live_sequences():
            for p in s.pages:
                if p < n and r0[p] != r1[p]:
                    holders.setdefault(int(p), []).append(s.request_id)
        rids = sorted({q for v in holders.values() for q in v})
        self.report("error", f"rank {r}: its account of live pages differs from the driver's pool on {len(pages)} "
                             f"pages {pages[:8].tolist()} (free {int((r1 == 0).sum())} vs {int((r0 == 0).sum())}; "
                             f"requests mapping them: {rids[:8]})", hint=HINT_POOL, kind="rank-pool-digest",
                    dedup=("rank-pool-digest", r, tuple(rids[:8])), step=step,
                    request_id=rids[0] if rids else None, page=int(pages[0]) if len(pages) else None,
                    evidence={**ev0, "pages": pages[:64].tolist(), "ref_rank": r1[pages[:64]].tolist(),
                              "ref_driver": r0[pages[:64]].tolist(), "requests": rids[:64]})
