"""The invariants of a packed, paged batch, as plain functions over arrays.

Every check compares what the kernels are handed (the bound block table, slot_mapping,
positions, cu_seqlens and their host copies) with a reference rebuilt from each
sequence's own state: its page list, the tokens it had computed before the step and
the chunk the scheduler gave it. Nothing here reads a version, a stamp or a checksum
that the checked code set itself. The functions take numpy arrays and lists, not
engine objects, so our probes and the vLLM adapter (query_start_loc, seq_lens,
block_table_tensor, slot_mapping) call the same code.

Everything is vectorised over tokens; the only Python loops run over sequences.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Sequence

import numpy as np

from workbench.step_record import as_numpy

MAX_REPORTED = 8          # mismatches one comparison returns (a broken tensor can have thousands)


@dataclass(frozen=True)
class Mismatch:
    """One entry of a checked tensor that disagrees with the reference."""
    check: str            # block-table | slot-mapping | positions | input-ids | lengths | logits-indices
    copy: str             # the tensor or host copy that disagrees, e.g. "cu_seqlens_q_np"
    row: int              # the sequence's index in the batch (-1: not tied to one sequence)
    index: int            # column (block table), token (packed row) or entry index
    got: int | None       # what the checked copy holds (None: the entry is missing)
    want: int | None      # what the sequence's own state says


@dataclass
class PackingReference:
    """What a packed batch must hold, rebuilt from each sequence's own state."""
    page_size: int
    starts: np.ndarray        # [B] tokens computed before this step
    q_lens: np.ndarray        # [B] tokens this step computes (the scheduler's decision)
    cu_q: np.ndarray          # [B+1] int64, cumulative q_lens from 0
    context_lens: np.ndarray  # [B] starts + q_lens
    cu_k: np.ndarray          # [B+1] cumulative context lengths from 0
    seq_of_tok: np.ndarray    # [T] the sequence each packed token belongs to
    positions: np.ndarray     # [T] each token's position in its sequence
    need: np.ndarray          # [B] pages each row maps: ceil(context / page_size)
    table: np.ndarray         # [B, max(need)] the pages meant (0 past need)
    short: np.ndarray         # [B] bool: the page list holds fewer than need pages
    slots: np.ndarray         # [T] page * page_size + offset (-1 where the page list is short)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_q[-1])


def reference(starts: Sequence[int], q_lens: Sequence[int], page_lists: Sequence[Sequence[int]],
              page_size: int) -> PackingReference:
    """The batch as the sequences mean it: positions, lengths, table and slots."""
    starts = np.asarray(starts, dtype=np.int64)
    q = np.asarray(q_lens, dtype=np.int64)
    b = len(q)
    cu_q = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(q, out=cu_q[1:])
    ctx = starts + q
    cu_k = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(ctx, out=cu_k[1:])
    t = int(cu_q[-1])
    seq_of_tok = np.repeat(np.arange(b), q)
    positions = np.arange(t, dtype=np.int64) - np.repeat(cu_q[:-1] - starts, q)
    need = -(-ctx // page_size)
    width = int(need.max()) if b else 0
    table = np.zeros((b, max(width, 1)), dtype=np.int64)
    have = np.fromiter((len(p) for p in page_lists), dtype=np.int64, count=b)
    k = np.minimum(have, need)
    # One flat copy of every row's first k pages, scattered into the table.
    flat = np.fromiter(chain.from_iterable(p[:n] for p, n in zip(page_lists, k.tolist())), dtype=np.int64,
                       count=int(k.sum()))
    rows = np.repeat(np.arange(b), k)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(k) - k, k)
    table[rows, cols] = flat
    col = positions // page_size
    ok = col < k[seq_of_tok]
    slots = np.where(ok, table[seq_of_tok, np.minimum(col, table.shape[1] - 1)] * page_size + positions % page_size,
                     -1)
    return PackingReference(page_size, starts, q, cu_q, ctx, cu_k, seq_of_tok, positions, need, table,
                            have < need, slots)


def _first_per_row(bad: np.ndarray, row_of: np.ndarray) -> np.ndarray:
    """Indices of the first True of `bad` for each row (rows given per entry), at most MAX_REPORTED."""
    idx = np.nonzero(bad)[0]
    if len(idx) == 0:
        return idx
    _, first = np.unique(row_of[idx], return_index=True)
    return idx[np.sort(first)][:MAX_REPORTED]


def compare_table(read: np.ndarray, ref: PackingReference, copy: str = "block_tables",
                  num_pages: int | None = None) -> list[Mismatch]:
    """The bound table [B, W] against the pages each sequence maps, over the columns it reads.

    Ids outside [0, num_pages) are left to the bounds check (they get their own finding)."""
    out: list[Mismatch] = []
    b = len(ref.q_lens)
    if read.ndim != 2 or read.shape[0] != b:
        return [Mismatch("block-table", copy, -1, -1, int(read.shape[0]) if read.ndim else None, b)]
    w = ref.table.shape[1]
    if read.shape[1] < w:                     # a table narrower than a row's context: columns missing
        rows = np.nonzero(ref.need > read.shape[1])[0]
        out += [Mismatch("block-table", copy, int(r), int(read.shape[1]), None, int(ref.table[r, read.shape[1]]))
                for r in rows[:MAX_REPORTED]]
        w = read.shape[1]
    cols = np.arange(w)[None, :] < np.minimum(ref.need, w)[:, None]
    a = read[:, :w]
    wrong = (a != ref.table[:, :w]) & cols & ~ref.short[:, None]
    if num_pages is not None:
        wrong &= (a >= 0) & (a < num_pages)
    r_idx, c_idx = np.nonzero(wrong)
    if len(r_idx):
        _, first = np.unique(r_idx, return_index=True)
        for k in first[:MAX_REPORTED]:
            r, c = int(r_idx[k]), int(c_idx[k])
            out.append(Mismatch("block-table", copy, r, c, int(a[r, c]), int(ref.table[r, c])))
    return out


def compare_tokens(check: str, copy: str, got: np.ndarray, want: np.ndarray, ref: PackingReference,
                   skip: np.ndarray | None = None) -> list[Mismatch]:
    """A per-token tensor [T] against the reference: the first bad token of each sequence."""
    t = ref.num_tokens
    if len(got) != t:
        return [Mismatch(check, copy, -1, min(len(got), t), len(got), t)]
    bad = got != want
    if skip is not None:
        bad &= ~skip
    return [Mismatch(check, copy, int(ref.seq_of_tok[i]), int(i), int(got[i]), int(want[i]))
            for i in _first_per_row(bad, ref.seq_of_tok)]


def compare_rows(check: str, copy: str, got: np.ndarray, want: np.ndarray, cumulative: bool = False) -> list[Mismatch]:
    """A per-sequence array [B] (or a cumulative one [B+1], whose entry i ends sequence i-1)."""
    got = np.asarray(got, dtype=np.int64).reshape(-1)
    if len(got) != len(want):
        return [Mismatch(check, copy, -1, min(len(got), len(want)), len(got), len(want))]
    idx = np.nonzero(got != want)[0][:MAX_REPORTED]
    return [Mismatch(check, copy, max(int(i) - cumulative, 0), int(i), int(got[i]), int(want[i])) for i in idx]


def packing_mismatches(ref: PackingReference, *, positions=None, slot_mapping=None, input_ids=None,
                       token_ids: np.ndarray | None = None, twins: dict | None = None) -> list[Mismatch]:
    """Every per-token and per-sequence tensor of a batch against the reference.

    twins: name -> (array, kind) where kind is "q" (query lengths [B]), "cu_q" ([B+1]),
    "ctx" (context lengths [B]), "cu_k" ([B+1]), "ends_q" / "ends_k" (cumulative without
    the leading 0, torch_npu's actual_seq_lengths / _kv) or "diff_q" (a cu_seqlens whose
    differences must be the query lengths)."""
    out: list[Mismatch] = []
    if positions is not None:
        out += compare_tokens("positions", "positions", positions, ref.positions, ref)
    if slot_mapping is not None:
        out += compare_tokens("slot-mapping", "slot_mapping", slot_mapping, ref.slots, ref, skip=ref.slots < 0)
    if input_ids is not None and token_ids is not None:
        out += compare_tokens("input-ids", "input_ids", input_ids, token_ids, ref)
    want = {"q": ref.q_lens, "cu_q": ref.cu_q, "ctx": ref.context_lens, "cu_k": ref.cu_k,
            "ends_q": ref.cu_q[1:], "ends_k": ref.context_lens}
    for name, (arr, kind) in (twins or {}).items():
        if arr is None:
            continue
        if kind == "diff_q":
            arr = np.diff(np.asarray(arr, dtype=np.int64).reshape(-1))
            kind = "q"
        out += compare_rows("lengths", name, arr, want[kind], cumulative=kind in ("cu_q", "cu_k"))
    return out


def tokens_at(token_lists: Sequence[Sequence[int]], ref: PackingReference) -> np.ndarray:
    """The token id each packed row must hold: its sequence's token at its position."""
    return np.fromiter(chain.from_iterable(toks[a:a + n] for toks, a, n in
                                           zip(token_lists, ref.starts.tolist(), ref.q_lens.tolist())),
                       dtype=np.int64, count=ref.num_tokens)


# ---- what a batch tells its kernels beside the index copies (our engine's PackedBatch) ----------
def maxima_mismatches(batch, ref: PackingReference) -> list[Mismatch]:
    """The longest query and context the batch says it has (what kernels size their work by)."""
    out = []
    for name, got, want in (("max_seqlen_q", batch.max_seqlen_q, ref.q_lens.max(initial=0)),
                            ("max_seqlen_k", batch.max_seqlen_k, ref.context_lens.max(initial=0))):
        if int(got) != int(want):
            out.append(Mismatch("lengths", name, int(np.argmax(ref.q_lens if name.endswith("q")
                                                               else ref.context_lens)), -1, int(got), int(want)))
    return out


def logits_mismatches(batch, ref: PackingReference) -> list[Mismatch]:
    """The sampled rows: the last row of every sequence whose context reaches its whole length (every
    row when all are: teacher forcing)."""
    got = as_numpy(batch.logits_indices).reshape(-1)
    t = ref.num_tokens
    if len(got) == t and t > 0 and (got == np.arange(t)).all():
        return []                                   # teacher forcing (score): every row
    total = np.fromiter((s.num_tokens for s in batch.seqs), dtype=np.int64, count=len(batch.seqs))
    rows = np.nonzero(ref.context_lens == total)[0]
    want = ref.cu_q[1:][rows] - 1
    if len(got) != len(want):
        return [Mismatch("logits-indices", "logits_indices", -1, -1, len(got), len(want))]
    bad = np.nonzero(got != want)[0][: MAX_REPORTED]
    return [Mismatch("logits-indices", "logits_indices", int(rows[k]), int(want[k]), int(got[k]), int(want[k]))
            for k in bad]


# ---- a whole StepRecord (workbench/step_record.py): our engine's and vLLM's alike ----------
def record_reference(record) -> PackingReference:
    """The reference of a StepRecord, from its reference half only; built once per record."""
    ref = getattr(record, "_reference", None)
    if ref is None:
        ref = record._reference = reference(record.computed, record.scheduled, record.pages, record.page_size)
    return ref


def membership_mismatches(record) -> list[Mismatch]:
    """Rows the batch holds that the scheduler did not schedule, and scheduled requests it lacks."""
    return ([Mismatch("scheduled", "batch.seqs", i, i, record.request_ids[i], None) for i in record.unscheduled]
            + [Mismatch("scheduled", "batch.seqs", -1, -1, None, n) for n in record.missing])


def record_mismatches(record, skip_kinds=()) -> list[Mismatch]:
    """Every copy of a StepRecord against its reference, each named by the record's own name for
    it (vLLM's block_table_tensor, our cu_seqlens_q_np ...). skip_kinds: kinds another check owns."""
    ref = record_reference(record)
    out = membership_mismatches(record)
    twins = {}
    for name, (kind, _) in record.copies.items():
        if kind in skip_kinds:
            continue
        got = record.array(name)
        if got is None:
            continue
        if kind == "block_table":
            out += compare_table(got, ref, name, record.num_pages)
        elif kind == "positions":
            out += compare_tokens("positions", name, got.reshape(-1), ref.positions, ref)
        elif kind == "slot_mapping":
            out += compare_tokens("slot-mapping", name, got.reshape(-1), ref.slots, ref, skip=ref.slots < 0)
        elif kind == "input_ids":
            if record.token_ids is not None:
                out += compare_tokens("input-ids", name, got.reshape(-1), tokens_at(record.token_ids, ref), ref)
        else:
            twins[name] = (got, kind)
    return out + packing_mismatches(ref, twins=twins)


# ---- the page pool -------------------------------------------------------------------
@dataclass(frozen=True)
class PoolViolation:
    rule: str             # counts | lost | free-with-refs | queue | cache-index | leak
    pages: tuple          # the pages concerned (a few)
    message: str


def walk_free_queue(head: int, nxt: Sequence[int], limit: int) -> tuple[list[int], str | None]:
    """The free queue from its head, following next links, at most limit + 1 steps
    (a cycle or a link out of range ends the walk with the reason)."""
    out, seen, p = [], set(), head
    n = len(nxt)
    while p != -1:
        if not 0 <= p < n:
            return out, f"link to page {p}, outside the pool [0, {n})"
        if p in seen or len(out) > limit:
            return out, f"the queue loops back to page {p}"
        seen.add(p)
        out.append(p)
        p = nxt[p]
    return out, None


def pool_violations(ref: np.ndarray, is_free: np.ndarray, has_hash: np.ndarray, free_walk: list[int],
                    walk_error: str | None, prev: np.ndarray, num_free: int, num_cached_free: int,
                    cached: dict, page_hash: Sequence) -> list[PoolViolation]:
    """The pool's accounting recomputed from its per-page arrays and its free queue.

    Every page is exactly one of: free (refcount 0, on the free queue, cached-free when it
    keeps a prefix hash) or used (refcount > 0, off the queue); the counters equal those
    counts; the queue is one well-linked chain; the prefix index and the page hashes agree."""
    out = []
    n = len(ref)
    free_n, used_n = int(is_free.sum()), int((ref > 0).sum())
    cached_free_n = int((is_free & has_hash).sum())
    lost = np.nonzero(~is_free & (ref <= 0))[0]
    if len(lost):
        out.append(PoolViolation("lost", tuple(lost[:MAX_REPORTED].tolist()),
                                 f"{len(lost)} pages are neither free nor referenced (refcount 0, off the free "
                                 f"queue): they can never be handed out again"))
    both = np.nonzero(is_free & (ref > 0))[0]
    if len(both):
        out.append(PoolViolation("free-with-refs", tuple(both[:MAX_REPORTED].tolist()),
                                 f"{len(both)} pages are on the free queue with refcount > 0: the next "
                                 f"allocation hands out a page someone still reads"))
    if free_n != num_free or cached_free_n != num_cached_free or free_n + used_n + len(lost) - len(both) != n:
        out.append(PoolViolation("counts", (),
                                 f"counters say {num_free} free ({num_cached_free} cached-free), the pages say "
                                 f"{free_n} free ({cached_free_n} cached-free) + {used_n} used + {len(lost)} lost "
                                 f"of {n}"))
    if walk_error is not None or len(free_walk) != free_n:
        out.append(PoolViolation("queue", tuple(free_walk[-MAX_REPORTED:]),
                                 f"the free queue holds {len(free_walk)} pages from its head, {free_n} pages are "
                                 f"flagged free" + (f"; {walk_error}" if walk_error else "")))
    if free_walk:
        w = np.asarray(free_walk, dtype=np.int64)
        off = w[~is_free[w]]
        if len(off):
            out.append(PoolViolation("queue", tuple(off[:MAX_REPORTED].tolist()),
                                     f"{len(off)} pages on the free queue are not flagged free"))
        back = prev[w[1:]] != w[:-1]
        if back.any():
            k = int(np.nonzero(back)[0][0])
            out.append(PoolViolation("queue", (int(w[k]), int(w[k + 1])),
                                     f"the free queue's links disagree: next of page {w[k]} is {w[k + 1]}, whose "
                                     f"prev is {prev[w[k + 1]]}"))
    bad_index = [(h, p) for h, p in cached.items() if not 0 <= p < n or page_hash[p] != h]
    hashed = np.nonzero(has_hash)[0]
    unindexed = [int(p) for p in hashed if cached.get(page_hash[p]) != p]
    if bad_index or unindexed:
        pages = tuple([p for _, p in bad_index][:MAX_REPORTED] + unindexed[:MAX_REPORTED])
        out.append(PoolViolation("cache-index", pages,
                                 f"the prefix index and the pages' hashes disagree: {len(bad_index)} index entries "
                                 f"point at a page holding another hash, {len(unindexed)} hashed pages are not "
                                 f"in the index"))
    return out
