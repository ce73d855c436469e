"""The checks the plugin runs on vLLM's state, as plain functions over arrays and lists.

The invariant code is our probes' own (probes/invariants.py: one implementation, two
callers); this module only says what in vLLM plays which part, and words the findings.
hooks.py reads vLLM's objects into these arguments; nothing here imports vLLM, so the
checks are tested on their own as well as inside a real server.

The reference is the workbench's own ledger (ledger.py), built from the SchedulerOutputs
that cross to the workers, never vLLM's lists of what is checked:
  - the attention metadata (query_start_loc, seq_lens, block_table_tensor, slot_mapping,
    positions) against each scheduled request's block ids in the ledger and the scheduler's
    token counts for the step;
  - the block pool (ref_cnt, the free queue's links, the prefix index) against the ledger's
    holders per KV cache group (each group by its own window rule) and the pins vLLM allows.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from probes import invariants
from probes.request_books import HINTS as REQUEST_HINTS
from workbench.step_record import StepRecord

PROBE_METADATA = "vllm_metadata"
PROBE_POOL = "vllm_pool"

HINTS = {
    "block-table": "the block table the kernel reads disagrees with the request's block ids: look at the "
                   "input batch's block table (add_row / append_row / condense / swap_states) and the "
                   "kernel block-size mapping",
    "slot-mapping": "slot = block_table[req, pos // block_size] * block_size + pos % block_size: look at "
                    "compute_slot_mapping and the positions it was given",
    "positions": "positions must run from each request's computed tokens: look at num_computed_tokens_cpu and "
                 "query_pos in _prepare_inputs",
    "lengths": "query_start_loc / seq_lens must follow the scheduler's num_scheduled_tokens and the computed "
               "tokens before the step",
    "leak": "blocks with references that no request maps are lost to the pool until restart: look at the "
            "free path the last holder took (finish, abort, preemption)",
    "orphan": "a request the scheduler no longer knows still holds blocks: its free was skipped (an abort "
              "or finish path that does not reach kv_cache_manager.free)",
    "refcount": "ref_cnt must equal the number of requests mapping the block: a block mapped by more "
                "requests than references is freed while still read",
    "short": "a running request maps fewer blocks than its computed tokens need",
    "queue": "the free queue and the blocks' ref_cnt disagree",
    "lost": "blocks neither free nor referenced can never be handed out again",
    "free-with-refs": "a block on the free queue with references is handed out while still read",
    "counts": "num_free_blocks disagrees with the free queue",
    "cache-index": "the prefix index (cached_block_hash_to_block) and the blocks' hashes disagree",
    "prefix-provenance": "a prefix-cache hit served a block filled for another token history: the block hash "
                         "must chain its parent and cover every token and extra key (LoRA, cache salt, multimodal "
                         "inputs) of the block: look at hash_block_tokens / the request's block hasher; reset the "
                         "prefix cache after the fix",
    "stalled": "a request waits although the pool could hold it: look at the admission path (the free-block "
               "arithmetic allocate_slots uses, a reservation never released, a request stuck at the head of "
               "the waiting queue blocking the rest)",
    "check-inactive": "a check that should run on this path has not: see the plugin's status lines in vLLM's log "
                      "(`kvwb vllm status`) for the hook it waits on",
    **{f"request-{k}": v for k, v in REQUEST_HINTS.items()},
}


def finding(probe: str, kind: str, severity: str, message: str, step: int | None, request_id=None,
            page: int | None = None, **evidence) -> dict:
    return {"probe": probe, "kind": kind, "severity": severity, "message": message, "hint": HINTS.get(kind, ""),
            "step": step, "request_id": request_id, "page": page, "evidence": evidence}


# ---- the attention metadata ---------------------------------------------------------------
def vllm_record(step: int, req_ids: list[str], starts, q_lens, page_lists, block_size: int, num_blocks: int | None,
                *, query_start_loc=None, seq_lens=None, block_table=None, slot_mapping=None,
                positions=None) -> StepRecord:
    """vLLM's side of a step as a StepRecord: the reference from the ledger (each request's computed
    tokens, scheduled tokens and block ids), the copies CommonAttentionMetadata hands the kernels."""
    copies = {name: (kind, arr) for name, kind, arr in (
        ("block_table_tensor", "block_table", block_table), ("slot_mapping", "slot_mapping", slot_mapping),
        ("positions", "positions", positions), ("query_start_loc", "cu_q", query_start_loc),
        ("seq_lens", "ctx", seq_lens)) if arr is not None}
    return StepRecord(step, "vllm", block_size, num_blocks, request_ids=list(req_ids), computed=starts,
                      scheduled=q_lens, pages=[list(p) for p in page_lists], copies=copies)


def metadata_findings(step: int, req_ids: list[str], starts, q_lens, page_lists, block_size: int,
                      num_blocks: int | None, **tensors) -> list[dict]:
    """CommonAttentionMetadata's tensors (as numpy) against the requests' own state."""
    return record_findings(vllm_record(step, req_ids, starts, q_lens, page_lists, block_size, num_blocks,
                                       **tensors))


def record_findings(record: StepRecord) -> list[dict]:
    """A vLLM StepRecord checked by the probes' own code (invariants.record_mismatches), worded."""
    step, req_ids, block_size, num_blocks = record.step, record.request_ids, record.page_size, record.num_pages
    ref = invariants.record_reference(record)
    mism = invariants.record_mismatches(record)
    bt = record.array("block_table_tensor")
    if bt is not None:
        mism += _out_of_range(bt, ref, num_blocks)
    by_check = defaultdict(list)
    for m in mism:
        by_check[(m.check, m.copy)].append(m)
    out = []
    for (check, copy), ms in by_check.items():
        first = ms[0]
        rid = req_ids[first.row] if 0 <= first.row < len(req_ids) else None
        where = _where(check, first, ref)
        rows = sorted({m.row for m in ms if m.row >= 0})
        out.append(finding(
            PROBE_METADATA, check, "error",
            f"step {step}: {copy} {where} holds {first.got}, request {rid} means {first.want}"
            + (f" ({len(rows)} requests affected: {', '.join(str(req_ids[r]) for r in rows[:4])})" if len(rows) > 1
               else ""),
            step, rid, _block_of(check, first.got, block_size),
            copy=copy, row=first.row, index=first.index, got=first.got, want=first.want,
            requests=[req_ids[r] for r in rows[:16]],
            **({"page_read": first.got, "page_meant": first.want} if check == "block-table" else {})))
    return out


def _block_of(check: str, got, block_size: int):
    """The block a finding names: the block id read (block-table) or the block a slot lies in."""
    if got is None or got < 0:
        return None
    if check == "block-table":
        return got
    if check == "slot-mapping":
        return got // block_size
    return None


def _where(check: str, m, ref) -> str:
    if check == "block-table":
        return f"row {m.row} column {m.index}"
    if check in ("slot-mapping", "positions", "input-ids"):
        pos = int(ref.positions[m.index]) if 0 <= m.index < len(ref.positions) else None
        return f"token {m.index} (position {pos} of row {m.row})"
    return f"entry {m.index}"


def _out_of_range(bt: np.ndarray, ref, num_blocks: int | None):
    if num_blocks is None or bt.ndim != 2 or bt.shape[0] != len(ref.q_lens):
        return []
    w = min(bt.shape[1], ref.table.shape[1])
    cols = np.arange(w)[None, :] < np.minimum(ref.need, w)[:, None]
    bad = cols & ((bt[:, :w] < 0) | (bt[:, :w] >= num_blocks))
    r, c = np.nonzero(bad)
    return [invariants.Mismatch("block-table", "block_table_tensor", int(i), int(j), int(bt[i, j]),
                                int(ref.table[i, j])) for i, j in list(zip(r, c))[:invariants.MAX_REPORTED]]


# ---- the block pool -----------------------------------------------------------------------
def pool_findings(step: int, ref, free_walk: list[int], walk_error: str | None, prev, num_free: int,
                  null_block: int | None, holders: dict[str, list[int]], live: dict[str, str],
                  index_errors: tuple[list[int], list[int]] = ([], []), last_holder: dict | None = None,
                  block_size: int | None = None, computed: dict[str, int] | None = None,
                  optional: dict[str, list[int]] | None = None) -> list[dict]:
    """The pool recomputed from its blocks against the ledger's per-request holders.

    ref: ref_cnt per block; free_walk: the free queue from its head; prev: each block's
    prev link (-1 none); holders: request id -> block ids it must hold (the ledger's, plus
    pins); live: the
    scheduler's requests -> status; index_errors: (index entries naming a block with
    another hash, hashed blocks missing from the index); last_holder: block -> the
    request that last mapped it (for naming leaks); optional: request -> blocks it may have
    let go (a sliding window's, a chunk's), which allow references but do not require them."""
    ref = np.asarray(ref, dtype=np.int64).copy()
    n = len(ref)
    if null_block is not None and 0 <= null_block < n:
        ref[null_block] = max(ref[null_block], 1)      # vLLM's null block: never free, its ref_cnt unkept
    is_free = np.zeros(n, dtype=bool)
    walk = np.asarray([p for p in free_walk if 0 <= p < n], dtype=np.int64)
    is_free[walk] = True
    out = []
    for v in invariants.pool_violations(ref, is_free, np.zeros(n, dtype=bool), free_walk, walk_error,
                                        np.asarray(prev, dtype=np.int64), num_free, 0, {}, [None] * n):
        out.append(finding(PROBE_POOL, v.rule, "error", f"step {step}: {v.message}", step,
                           page=v.pages[0] if v.pages else None, pages=list(v.pages)))
    bad_index, unindexed = index_errors
    if bad_index or unindexed:
        out.append(finding(PROBE_POOL, "cache-index", "error",
                           f"step {step}: {len(bad_index)} prefix-index entries name a block holding another "
                           f"hash, {len(unindexed)} hashed blocks are missing from the index", step,
                           page=(bad_index or unindexed)[0], pages=(bad_index + unindexed)[:16]))
    # ref_cnt against the requests that map each block
    mapped = _bincount(holders, n, null_block)
    may = _bincount(optional or {}, n, null_block)
    if null_block is not None and 0 <= null_block < n:
        mapped[null_block], may[null_block] = ref[null_block], 0
    owners = defaultdict(list)
    for rid, pages in holders.items():
        for p in pages:
            owners[p].append(rid)
    out += _leak_findings(step, np.nonzero((ref > 0) & (mapped + may == 0))[0], last_holder)
    wrong = np.nonzero(((ref < mapped) | (ref > mapped + may)) & (mapped + may > 0))[0]
    for p in wrong[:invariants.MAX_REPORTED].tolist():
        rids = owners.get(p, [])
        out.append(_refcount(step, p, int(ref[p]), int(mapped[p]), int(may[p]), rids))
    for rid, pages in holders.items():
        if rid not in live and pages:
            out.append(finding(PROBE_POOL, "orphan", "error",
                               f"step {step}: request {rid} is no longer scheduled but still holds {len(pages)} "
                               f"blocks", step, rid, pages[0], pages=pages[:16]))
    if block_size and computed:
        for rid, c in computed.items():
            have = len(holders.get(rid, ()))
            if have * block_size < c:
                out.append(finding(PROBE_POOL, "short", "error",
                                   f"step {step}: request {rid} has computed {c} tokens but maps {have} blocks of "
                                   f"{block_size}", step, rid, None, computed=c, blocks=have))
    return out


def _bincount(holders: dict[str, list[int]], n: int, null_block: int | None) -> np.ndarray:
    flat = [p for pages in holders.values() for p in pages if 0 <= p < n and p != null_block]
    return np.bincount(np.asarray(flat, dtype=np.int64), minlength=n) if flat else np.zeros(n, dtype=np.int64)


def _refcount(step: int, p: int, ref: int, must: int, may: int, rids: list[str]) -> dict:
    """ref_cnt outside [requests that must hold the block, + those that may have let it go]."""
    if ref < must:
        what = f"block {p} has ref_cnt {ref} but {must} requests still read it"
        if ref == 0:
            what += " (freed while in use: its next owner overwrites their K/V)"
    else:
        what = f"block {p} has ref_cnt {ref} but {must + may} requests map it"
    if rids:
        what += f": {', '.join(map(str, rids[:4]))}"
    return finding(PROBE_POOL, "refcount", "error", f"step {step}: {what}",
                   step, rids[0] if rids else None, p, ref_cnt=ref, mapped=must, may_have_freed=may,
                   requests=rids[:16])


def _leak_findings(step: int, leaked, last_holder: dict | None) -> list[dict]:
    """Blocks with references that no request maps: one finding per request that last held them."""
    last = last_holder or {}
    by = defaultdict(list)
    for p in np.asarray(leaked).tolist():
        by[last.get(p)].append(p)
    return [finding(PROBE_POOL, "leak", "error",
                    f"step {step}: {len(pages)} blocks keep references but no request maps them"
                    + (f"; last held by request {rid}" if rid is not None else ""),
                    step, rid, pages[0], pages=pages[:16]) for rid, pages in by.items()]


def touched_block_findings(step: int, blocks, ref, in_queue, expected, last_holder: dict | None = None,
                           pins: dict | None = None, may=None, who=None) -> list[dict]:
    """The incremental pool check: only the blocks this step touched (allocated, freed, evicted,
    a window's edge).

    blocks: the block ids; ref: their ref_cnt; in_queue: on the free queue; expected: how many
    holders must hold each (the ledger's, and the pins: deferred frees, a connector's delayed
    free); may: how many more may have let it go (a window's); who(block): the requests
    mapping it, for naming. The same rules as the full sweep, on a handful of blocks."""
    blocks = np.asarray(blocks, dtype=np.int64)
    ref = np.asarray(ref, dtype=np.int64)
    in_queue = np.asarray(in_queue, dtype=bool)
    expected = np.asarray(expected, dtype=np.int64)
    may = np.zeros_like(expected) if may is None else np.asarray(may, dtype=np.int64)
    last = last_holder or {}
    out = []
    out += _leak_findings(step, blocks[(ref > 0) & (expected + may == 0)], last)
    wrong = ((ref < expected) | (ref > expected + may)) & (expected + may > 0)
    for i in np.nonzero(wrong)[0][:invariants.MAX_REPORTED].tolist():
        p = int(blocks[i])
        held = who(p) if who is not None else []
        rids = list(dict.fromkeys(r for r, _, _ in held)) or ([last[p]] if last.get(p) is not None else [])
        f = _refcount(step, p, int(ref[i]), int(expected[i]), int(may[i]), rids)
        if held:
            f["message"] += " (" + ", ".join(f"{r}'s block {j} of KV cache group {g}" for r, g, j in held[:4]) + ")"
            f["evidence"]["held_as"] = [{"request": r, "kv_cache_group": g, "index": j} for r, g, j in held[:16]]
        out.append(f)
    lost = blocks[(ref == 0) & ~in_queue]
    if len(lost):
        out.append(finding(PROBE_POOL, "lost", "error",
                           f"step {step}: {len(lost)} blocks are neither free nor referenced", step,
                           last.get(int(lost[0])), int(lost[0]), pages=lost[:16].tolist()))
    busy = blocks[(ref > 0) & in_queue]
    if len(busy):
        out.append(finding(PROBE_POOL, "free-with-refs", "error",
                           f"step {step}: {len(busy)} blocks on the free queue still have references", step,
                           last.get(int(busy[0])), int(busy[0]), pages=busy[:16].tolist()))
    return out


def inactive_finding(probe: str, check: str, steps: int, why: str) -> dict:
    return finding(probe, "check-inactive", "warn",
                   f"{check} has not run for {steps} steps with work: {why}", None, check=check, steps=steps)


def provenance_finding(step: int, m, block_size: int) -> dict:
    """probes/provenance.py's Mismatch as a finding: the requester, the block, the first differing token."""
    where = (f"first differing token at position {m.position}" if m.position >= 0
             else "the same tokens under other extra keys (LoRA, cache salt, multimodal input)")
    return finding(PROBE_POOL, "prefix-provenance", "error",
                   f"step {step}: request {m.request} got a prefix-cache hit on block {m.block} (its block "
                   f"{m.index}), filled for request {m.filled_for} as its block {m.recorded_index}: {where}",
                   step, m.request, m.block, position=m.position, filled_for=m.filled_for, index=m.index,
                   recorded_index=m.recorded_index)
