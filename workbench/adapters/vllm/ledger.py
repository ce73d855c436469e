"""The workbench's own record of which request holds which blocks, per KV cache group.

Built only from what crosses vLLM's scheduler -> worker boundary, the SchedulerOutput
(new requests' block ids, running requests' new block ids, resumed requests' whole lists,
preempted and finished ids), plus the finished ids the engine core has not yet reported.
It never reads the KV cache manager's per-request lists, so a bug that keeps those lists
self-consistent with the pool still disagrees with this record.

Both sides keep one: the engine core (the pool is checked against it) and each worker (the
block table the kernel reads is checked against it). Each step's changes are returned as a
Delta: the blocks the step touched, which is what the incremental pool check looks at.
Nothing here imports vLLM; it reads the SchedulerOutput by attribute.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Entry:
    groups: list[list[int]]                 # block ids per KV cache group
    computed: int = 0                       # tokens computed before the step that last scheduled it
    scheduled: int = 0                      # tokens that step scheduled


@dataclass
class Delta:
    added: set[int] = field(default_factory=set)      # blocks newly mapped by a request
    removed: set[int] = field(default_factory=set)    # blocks a finished / preempted request let go
    released: dict[str, list[int]] = field(default_factory=dict)   # request -> blocks it let go

    def touched(self) -> set[int]:
        return self.added | self.removed


class BlockLedger:
    def __init__(self, num_blocks: int | None = None):
        self.reqs: dict[str, Entry] = {}
        self.last_holder: dict[int, str] = {}
        self.steps = 0
        self.counts = None if num_blocks is None else np.zeros(num_blocks, dtype=np.int64)

    def _map(self, rid: str, groups, delta: Delta, replace: bool) -> None:
        e = self.reqs.get(rid)
        if e is None or replace:
            if e is not None:
                self._release(rid, delta)
            e = self.reqs[rid] = Entry([[] for _ in groups])
        while len(e.groups) < len(groups):
            e.groups.append([])
        for g, ids in enumerate(groups):
            if not ids:
                continue
            e.groups[g].extend(int(b) for b in ids)
            for b in ids:
                b = int(b)
                delta.added.add(b)
                self.last_holder[b] = rid
                if self.counts is not None and 0 <= b < len(self.counts):
                    self.counts[b] += 1

    def _release(self, rid: str, delta: Delta) -> None:
        e = self.reqs.pop(rid, None)
        if e is None:
            return
        blocks = [b for ids in e.groups for b in ids]
        for b in blocks:                    # the last request to map or let go of a block names it
            self.last_holder[b] = rid
        delta.released[rid] = blocks
        delta.removed.update(blocks)
        if self.counts is not None:
            idx = np.asarray([b for b in blocks if 0 <= b < len(self.counts)], dtype=np.int64)
            np.subtract.at(self.counts, idx, 1)

    def apply(self, so) -> Delta:
        """One SchedulerOutput, in the order vLLM's workers apply it."""
        d = Delta()
        self.steps += 1
        for rid in getattr(so, "finished_req_ids", None) or ():
            self._release(rid, d)
        for rid in getattr(so, "preempted_req_ids", None) or ():
            self._release(rid, d)
        sched = getattr(so, "num_scheduled_tokens", None) or {}
        for nr in getattr(so, "scheduled_new_reqs", None) or ():
            self._map(nr.req_id, nr.block_ids, d, replace=True)
            e = self.reqs[nr.req_id]
            e.computed, e.scheduled = int(nr.num_computed_tokens), int(sched.get(nr.req_id, 0))
        c = getattr(so, "scheduled_cached_reqs", None)
        if c is not None:
            resumed = set(getattr(c, "resumed_req_ids", None) or ())
            for i, rid in enumerate(c.req_ids):
                new = c.new_block_ids[i] if i < len(c.new_block_ids) else None
                if rid in resumed:
                    self._map(rid, new or (), d, replace=True)
                elif new:
                    self._map(rid, new, d, replace=False)
                e = self.reqs.get(rid)
                if e is None:                  # a running request the ledger never saw added
                    e = self.reqs[rid] = Entry([])
                e.computed, e.scheduled = int(c.num_computed_tokens[i]), int(sched.get(rid, 0))
        return d

    def finish(self, rids) -> Delta:
        """Requests the engine core has finished (or aborted) but not yet reported in an output."""
        d = Delta()
        for rid in rids:
            self._release(rid, d)
        return d

    def holders(self, group: int | None = None) -> dict[str, list[int]]:
        if group is None:
            return {r: [b for ids in e.groups for b in ids] for r, e in self.reqs.items()}
        return {r: list(e.groups[group]) if group < len(e.groups) else [] for r, e in self.reqs.items()}

    def mapped(self, n: int, null_block: int | None = None) -> np.ndarray:
        """How many requests map each block (all groups), recounted from the record."""
        flat = [b for e in self.reqs.values() for ids in e.groups for b in ids if 0 <= b < n and b != null_block]
        return np.bincount(np.asarray(flat, dtype=np.int64), minlength=n)[:n] if flat else np.zeros(n, np.int64)
