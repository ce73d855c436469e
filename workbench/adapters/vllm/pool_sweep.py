"""The pool check beyond the blocks a step touched: a rotating slice each step, the full sweep at idle.

A mixin of PoolWatch (engine_side.py). Each step reads a slice of `sweep_slice` blocks besides those
the step touched (the whole pool every num_blocks / sweep_slice steps; no step pays for the whole
pool) and sends the slice's part of the page map's snapshot. The full sweep (the free queue walked
link by link, the prefix index against the blocks' hashes, the whole snapshot) runs when vLLM goes
idle, on the plugin's thread. Blocks vLLM holds on purpose for no request the ledger knows
(deferred frees, a connector's delayed frees, unmodelled groups) are pins.
"""
from __future__ import annotations

import operator

import numpy as np

from . import sanitizer


_REF, _PREV, _NEXT, _HASH = (operator.attrgetter(a) for a in ("ref_cnt", "prev_free_block", "next_free_block",
                                                              "block_hash"))


def in_queue(b) -> bool:
    # FreeKVCacheBlockQueue keeps fake head and tail blocks: a block on it has both links
    return b.prev_free_block is not None and b.next_free_block is not None


class PoolSweep:
    def _slice(self, n: int) -> tuple[int, int]:
        """This step's slice [lo, hi) of the pool, moving on each step and wrapping round."""
        k = min(self.s.sweep_slice, n)
        if k <= 0:
            return 0, 0
        lo = self.cursor if self.cursor < n else 0
        hi = min(n, lo + k)
        self.cursor = hi if hi < n else 0
        return lo, hi

    def _read_slice(self, blocks, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ref_cnt, on the free queue, holds a prefix hash) of blocks lo..hi-1, the null block included:
        each attribute read by a C-level map over the slice, not a Python loop per block."""
        sl = blocks[lo:hi]
        ref = np.fromiter(map(_REF, sl), dtype=np.int64, count=hi - lo)
        prev = np.array([x is not None for x in map(_PREV, sl)], dtype=bool)
        nxt = np.array([x is not None for x in map(_NEXT, sl)], dtype=bool)
        hashed = np.array([x is not None for x in map(_HASH, sl)], dtype=bool)
        return ref, prev & nxt, hashed

    def _slice_snapshot(self, blocks, lo: int, hi: int, ref, free, hashed):
        """The slice's part of the page map's snapshot (ref, owner, cached), sent with its offset: the
        listener patches it into its last full snapshot. Owners from the ledger's last holder of each
        block (a name the dashboard colours by), not a scan."""
        owner = np.full(hi - lo, -1, dtype=np.int32)
        new = {}
        last = self.ledger.last_holder
        counts = self.ledger.counts
        for j in np.flatnonzero(counts[lo:hi] > 0).tolist():
            rid = last.get(lo + j)
            if rid is None:
                continue
            i = self.names.get(rid)
            if i is None:
                i = self.names[rid] = self.next_name
                self.next_name += 1
                new[i] = rid
            owner[j] = i
        if len(self.names) > 4 * max(1, len(self.ledger.reqs)) + 1024:     # ids of ended requests: bounded
            live = set(self.ledger.reqs)
            self.names = {r: i for r, i in self.names.items() if r in live}
        return (ref.astype(np.int32), owner, (free & hashed).astype(np.uint8)), {"names": new, "slice_lo": lo}

    def _pins(self, scheduler, kvm) -> dict[int, list[str]]:
        """Blocks with references that no running request holds, for a reason vLLM allows: frees
        deferred behind an in-flight step; with a KV connector, blocks of requests the workers have
        not seen (a delayed free after finishing, an asynchronous load: WAITING_FOR_REMOTE_KVS)."""
        pins: dict[int, list[str]] = {}
        for fence, bl in list(getattr(scheduler, "deferred_frees", ()) or ()):
            for b in bl:
                pins.setdefault(b.block_id, []).append(f"deferred free (fence step {fence})")
        mgrs = scheduler.kv_cache_manager.coordinator.single_type_managers
        pool = scheduler.kv_cache_manager.block_pool
        for g, rule in enumerate(self.rules):
            # a Mamba / state group: vLLM's own lists, named (not a manager with its own host pool)
            if rule is None and g < len(mgrs) and getattr(mgrs[g], "block_pool", pool) is pool:
                why = f"group {g} ({type(mgrs[g]).__name__}): not modelled by the ledger"
                for rid, bl in list(mgrs[g].req_to_blocks.items()):
                    for b in bl:
                        if not getattr(b, "is_null", False):
                            pins.setdefault(b.block_id, []).append(f"{rid}: {why}")
        conn = getattr(scheduler, "connector", None)
        if conn is None:
            return pins                   # without a connector every holder crosses to the workers
        for rid, r in list(scheduler.requests.items()):
            if rid in self.ledger.reqs:
                continue
            fin = getattr(r, "is_finished", None)
            why = ("finished, free delayed" if fin is not None and fin()
                   else getattr(getattr(r, "status", None), "name", "not scheduled yet"))
            for g, ids in enumerate(kvm.get_block_ids(rid)):
                if g < len(self.rules) and self.rules[g] is None:
                    continue                              # pinned above already
                for b in ids:
                    pins.setdefault(b, []).append(f"{rid}: {why} ({type(conn).__name__})")
        return pins

    def _sweep(self, scheduler, pool, blocks, n, null, pins, idle):
        ref = np.fromiter((b.ref_cnt for b in blocks), dtype=np.int64, count=n)
        has_hash = np.fromiter((b.block_hash is not None for b in blocks), dtype=bool, count=n)
        prev = np.fromiter((-1 if b.prev_free_block is None else b.prev_free_block.block_id for b in blocks),
                           dtype=np.int64, count=n)
        q = pool.free_block_queue
        walk, err, b = [], None, q.fake_free_list_head.next_free_block
        tail = q.fake_free_list_tail
        while b is not None and b is not tail:
            if len(walk) > n:
                err = "the free queue loops"
                break
            walk.append(b.block_id)
            b = b.next_free_block
        holders = self.ledger.holders()
        for blk, why in pins.items():
            for w in why:
                holders.setdefault(f"<pinned: {w}>", []).append(blk)
        live = {rid: "held" for rid in holders}
        computed = None
        if len(self.rules) == 1 and self.rules[0] is not None and self.rules[0].kind == "full":
            computed = {r: e.computed + e.scheduled for r, e in self.ledger.reqs.items()}
        found = sanitizer.pool_findings(self.checked_at, ref, walk, err, prev, q.num_free_blocks, null, holders, live,
                                        index_errors(pool, has_hash), self.ledger.last_holder,
                                        scheduler.block_size, computed, self.ledger.holders(optional=True))
        owner = np.full(n, -1, dtype=np.int32)
        new, names = {}, {}
        for rid, pages in holders.items():
            i = self.names.get(rid)
            if i is None:
                i = self.next_name
                self.next_name += 1
                new[i] = rid
            names[rid] = i
            idx = np.asarray(pages, dtype=np.int64)
            idx = idx[(idx >= 0) & (idx < n)]
            owner[idx[owner[idx] < 0]] = i
        self.names = names          # only the current holders: a server's lifetime of ids is not kept
        is_free = np.zeros(n, dtype=bool)
        is_free[[p for p in walk if 0 <= p < n]] = True
        cached = (is_free & has_hash).astype(np.uint8)
        extra = {"names": new, "hashed": int(has_hash.sum())}
        if idle:
            # the prefix cache's block hashes as vLLM's KV events spell them (its own conversion)
            from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash
            hs = [maybe_convert_block_hash(get_block_hash(b.block_hash)) for b in blocks if b.block_hash is not None]
            extra["hashes"] = [h if isinstance(h, int) else h.hex() for h in hs]
        return found, (ref.astype(np.int32), owner, cached), extra


def index_errors(pool, has_hash) -> tuple[list[int], list[int]]:
    """(index entries naming a block with another hash, hashed blocks the index lacks)."""
    cache = getattr(pool.cached_block_hash_to_block, "_cache", None)
    if cache is None:
        return [], []
    bad, indexed = [], set()
    for key, entry in cache.items():
        for blk in (entry.values() if isinstance(entry, dict) else (entry,)):
            indexed.add(blk.block_id)
            if blk.block_hash != key:
                bad.append(blk.block_id)
    missing = [int(i) for i in np.nonzero(has_hash)[0] if int(i) not in indexed]
    return bad[:16], missing[:16]
