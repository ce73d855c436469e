"""PageWriteLedger: which request's history was last written to each KV slot, from the step records.

A prefix-cache hit is decided by the engine's index (hash -> page). If the index is wrong (an
entry that outlived an eviction, a page rewritten while still indexed, a hash that forgets its
parent), the hit serves K/V computed for another history, and a check that reads the index's own
records (page tokens, page index, parent hash) agrees with the bug. This ledger never reads the
index: for every step it records, for each slot the kernel wrote (the step record's slot mapping,
what the kernel was handed), the writing request, the token position, the token and a digest of
the writer's whole token prefix through that position. A hit is then checked slot by slot: the
hitting request's own prefix digest at each cached position must equal the digest last written
to the slot its page list names. The index becomes something the ledger checks (audit()).

The digest is a polynomial hash mod 2**64, D(n) = sum_{k<=n} (t_k + 1) * B**(n-k) (+ the seed of
whatever else changes K/V), computed for a whole step's tokens at once in numpy:
D(n) = B**n * S(n) with S(n) = seed + sum_{k<=n} (t_k + 1) * B**-k, so a request's running S
carries it from step to step and a step's digests are one cumulative sum. Not a cryptographic
hash: it guards against bugs, not adversaries (a collision between two real histories is ~2**-64).

Memory: 24 bytes a slot (writer, position, token, digest).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_BASE = 0x100000001B3                      # FNV-64's prime: odd, so invertible mod 2**64
_BASE_INV = pow(_BASE, -1, 1 << 64)
U64 = np.uint64


class _Powers:
    """B**k and B**-k mod 2**64 for k < n, grown by doubling."""

    def __init__(self):
        self.fwd = np.ones(1, dtype=U64)
        self.inv = np.ones(1, dtype=U64)

    def upto(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if n > len(self.fwd):
            m = max(n, 2 * len(self.fwd), 1024)
            with np.errstate(over="ignore"):
                self.fwd = np.cumprod(np.full(m, _BASE, dtype=U64), dtype=U64) * U64(_BASE_INV)
                self.inv = np.cumprod(np.full(m, _BASE_INV, dtype=U64), dtype=U64) * U64(_BASE)
        return self.fwd, self.inv


_POW = _Powers()


def prefix_digests(tokens, seed: int = 0) -> np.ndarray:
    """D(n) for every position n of tokens (uint64): the reference the ledger's steps must agree with."""
    t = np.asarray(tokens, dtype=np.int64)
    fwd, inv = _POW.upto(len(t))
    with np.errstate(over="ignore"):
        s = U64(seed) + np.cumsum((t + 1).astype(U64) * inv[: len(t)], dtype=U64)
        return fwd[: len(t)] * s


@dataclass
class Mismatch:
    """A cached position whose slot holds another history than the requester's."""
    request: object
    position: int          # the requester's token position
    slot: int
    page: int
    page_index: int        # where the requester holds the page
    written_by: object     # the request whose write the slot holds (None: never written while watched)
    written_pos: int       # the position that request wrote there (-1: never written)
    same_tokens: bool      # the page's tokens equal the requester's there (only the history before differs)


class PageWriteLedger:
    def __init__(self, num_pages: int, page_size: int, seed: int = 0):
        n = num_pages * page_size
        self.num_pages, self.page_size, self.seed = num_pages, page_size, seed
        self.writer = np.full(n, -1, dtype=np.int64)       # request id (ints: our engine's)
        self.pos = np.full(n, -1, dtype=np.int64)
        self.tok = np.full(n, -1, dtype=np.int64)
        self.digest = np.zeros(n, dtype=U64)
        self.state: dict[object, tuple[int, int]] = {}     # request -> (positions digested, S through them)
        self.slots_written = 0
        self.positions_checked = 0
        self.verified: list[tuple] = []
        self.pages_written: list[int] = []                 # the distinct pages the last step wrote

    # ---- one step ------------------------------------------------------------------------------
    def step(self, rows, slot_mapping: np.ndarray, strict: bool = False, before: np.ndarray | None = None
             ) -> list[Mismatch]:
        """Check, then record, one step. rows: per batch row (request id, tokens, computed before the
        step, tokens scheduled, its page list), in the slot mapping's order. Positions a request has
        not written or checked since it was (re)admitted and that lie before its computed count (a
        prefix-cache hit) are checked against the slots its page list names; then this step's
        positions are recorded at the slots the kernel wrote. Returns the first mismatch per row.
        strict: the ledger has watched every write since the pool was new, so a cached position
        whose slot was never written is a mismatch too (else: written before we watched, unjudged).
        before: an int64 array as long as slot_mapping, filled with the request each slot held before
        this step's writes (-1: none, or outside the ledger): what the index audit names.
        (page_writes_native.ledger_step runs a clean step compiled and leaves the rest to this.)"""
        ps, nslots = self.page_size, len(self.writer)
        toks, row_of, starts, s0, wrote, dones = [], [], [], [], [], []
        verify = []                                         # (row, first position, end) to check
        off = 0
        state, seed = self.state, self.seed
        for i, (rid, tokens, c, n, pages) in enumerate(rows):
            done, s = state.get(rid, (0, seed))
            if c < done:                                    # recomputed from a preemption (or a repage)
                done, s = 0, seed
            end = c + n
            if end <= done:
                continue
            if done < c:
                verify.append((i, done, c))
            toks.append(tokens[done:end])
            row_of.append(i)
            starts.append(off)
            dones.append(done)
            s0.append(s)
            wrote.append((c - done, n, off))
            off += end - done
        if before is not None and slot_mapping is not None:
            full = np.asarray(slot_mapping, dtype=np.int64)
            inside = (full >= 0) & (full < nslots)
            before[:] = np.where(inside, self.writer[np.where(inside, full, 0)], -1)
        self.pages_written = []
        if not toks:
            self.verified = []
            return []
        t = np.fromiter((x for seg in toks for x in seg), dtype=np.int64, count=off)
        lens = np.diff(np.append(starts, off))
        # each digested entry's position: its row's first undigested one, plus its place in the row
        p = np.arange(off, dtype=np.int64) + np.repeat(np.asarray(dones, dtype=np.int64) - starts, lens)
        fwd, inv = _POW.upto(int(p.max()) + 1)
        with np.errstate(over="ignore"):
            cs = np.cumsum((t + 1).astype(U64) * inv[p], dtype=U64)
            prior = np.where(np.asarray(starts) > 0, cs[np.maximum(np.asarray(starts) - 1, 0)], U64(0))
            base = np.asarray(s0, dtype=U64) - prior.astype(U64)
            s_all = np.repeat(base, lens) + cs
            d = fwd[p] * s_all
        # ---- check what the request did not write itself (its hits) before this step's writes land
        found = []
        self.verified = []                                  # (request, first position, end) checked this step
        where = {i: k for k, i in enumerate(row_of)}
        for i, lo, hi in verify:
            k = where[i]
            a = starts[k]
            rid, tokens, _, _, pages = rows[i]
            pos = np.arange(lo, hi, dtype=np.int64)
            pg = np.asarray(pages, dtype=np.int64)
            if hi > len(pg) * ps:
                continue                                    # short page list: the page_table probe's finding
            slots = pg[pos // ps] * ps + pos % ps
            ok_slot = (slots >= 0) & (slots < nslots)
            slots = np.where(ok_slot, slots, 0)
            got = self.digest[slots]
            known = self.writer[slots] >= 0
            bad = ok_slot & (known | strict) & (got != d[a:a + (hi - lo)])
            self.positions_checked += int(np.count_nonzero(known))
            self.verified.append((rid, lo, hi))
            if bad.any():
                j = int(np.argmax(bad))
                found.append(self._mismatch(rid, tokens, int(pos[j]), int(slots[j])))
        # ---- record this step's writes at the slots the kernel was handed
        total = sum(n for _, n, _ in wrote)
        sm = np.asarray(slot_mapping, dtype=np.int64)[:total] if slot_mapping is not None else None
        if sm is not None and len(sm) == total:
            w = np.asarray(wrote, dtype=np.int64).reshape(-1, 3)          # (skip, n, start) per row
            # this step's own entries: [start + skip, start + skip + n) of each row, in row order
            idx = np.arange(total, dtype=np.int64) + np.repeat(w[:, 2] + w[:, 0] - (np.cumsum(w[:, 1]) - w[:, 1]), w[:, 1])
            rid_col = np.repeat(np.asarray([rows[i][0] for i in row_of], dtype=np.int64),
                                [n for _, n, _ in wrote])
            ok = (sm >= 0) & (sm < nslots)
            s = sm[ok]
            self.writer[s] = rid_col[ok]
            self.pos[s] = p[idx][ok]
            self.tok[s] = t[idx][ok]
            self.digest[s] = d[idx][ok]
            self.slots_written += int(len(s))
            self.pages_written = list(dict.fromkeys((s // ps).tolist()))
        for k, i in enumerate(row_of):
            rid, tokens, c, n, _ = rows[i]
            self.state[rid] = (c + n, int(s_all[starts[k] + lens[k] - 1]))
        return found

    def _mismatch(self, rid, tokens, pos: int, slot: int) -> Mismatch:
        ps = self.page_size
        page, j = slot // ps, pos // ps
        w = int(self.writer[slot])
        lo = page * ps
        own = np.asarray(tokens[j * ps:(j + 1) * ps], dtype=np.int64)
        got = self.tok[lo:lo + len(own)]
        return Mismatch(rid, pos, slot, page, j, None if w < 0 else w, int(self.pos[slot]),
                        bool(len(own) and np.array_equal(own, got)))

    def forget(self, request) -> None:
        """The request finished: its running digest goes (what it wrote stays, as the slots hold it)."""
        self.state.pop(request, None)

    # ---- the index, checked against what was written --------------------------------------------
    def audit_page(self, page: int, index: int, tokens) -> str | None:
        """An index entry says `page` holds page `index` of a history whose tokens there are `tokens`.
        None when what was written there agrees; else why not (one writer, its positions, its tokens)."""
        ps = self.page_size
        sl = slice(page * ps, (page + 1) * ps)
        w, pos, tok = self.writer[sl], self.pos[sl], self.tok[sl]
        if (w < 0).all():
            return None                                     # written before the ledger watched
        if (w < 0).any():
            return f"slots {np.flatnonzero(w < 0).tolist()} were never written"
        if (w != w[0]).any():
            others = sorted(set(w.tolist()) - {int(w[0])})
            return f"its slots hold writes of requests {[int(w[0])] + others}: one history was partly overwritten"
        if index >= 0 and not np.array_equal(pos, np.arange(index * ps, (index + 1) * ps)):
            return (f"request {int(w[0])} wrote positions {int(pos[0])}..{int(pos[-1])} there, the index says "
                    f"page {index} (positions {index * ps}..{(index + 1) * ps - 1})")
        if tokens is not None and not np.array_equal(tok, np.asarray(tokens, dtype=np.int64)):
            return f"request {int(w[0])} wrote other tokens there than the index records"
        return None
