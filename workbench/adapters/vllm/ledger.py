"""The workbench's own record of which request holds which blocks, per KV cache group.

Built only from what crosses vLLM's scheduler -> worker boundary, the SchedulerOutput
(new requests' block ids, running requests' new block ids, resumed requests' whole lists,
preempted and finished ids), plus the finished ids the engine core has not yet reported.
It never reads the KV cache manager's per-request lists, so a bug that keeps those lists
self-consistent with the pool still disagrees with this record.

Each KV cache group follows its own rule (`GroupRule`), recomputed here from the group's
spec, not asked of vLLM: a full-attention group holds every block until the request ends; a
sliding-window group may free the blocks that fell out of its window (vLLM does so mid-request,
replacing them with its null block, and never tells the workers); a chunked-local group those
before the current chunk. So per block the ledger keeps two counts: `counts`, the requests that
must hold it (its ref_cnt can be no lower), and `optional`, those that may have let it go (no
higher than both together). A block whose last holder let it go is a leak if it keeps references.

Both sides keep one: the engine core (the pool is checked against it) and each worker (the
block table the kernel reads is checked against it). Each step's changes are returned as a
Delta: the blocks the step touched plus each scheduled request's window edge (its oldest
block that must still be held), which is what the incremental pool check looks at.
Nothing here imports vLLM; it reads the SchedulerOutput by attribute.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class GroupRule:
    """How many leading tokens of a request a group may have freed, at `computed` tokens."""
    kind: str = "full"                      # full | sliding | chunked | unmodelled (not counted)
    window: int = 0                         # sliding window or chunk size, tokens
    retained: int = 0                       # tokens kept past the window's trailing edge (spec decode)

    def skipped(self, computed: int) -> int:
        if self.kind == "sliding":
            return max(0, computed - self.window + 1 - self.retained)
        if self.kind == "chunked":
            return (computed // self.window) * self.window
        return 0


@dataclass
class Entry:
    groups: list[list[int]]                 # block ids per KV cache group
    computed: int = 0                       # tokens computed before the step that last scheduled it
    scheduled: int = 0                      # tokens that step scheduled
    processed: int = 0                      # tokens whose step's results are back (vLLM frees on this basis)
    floor: list[int] = field(default_factory=list)   # per group: leading blocks it may have let go


@dataclass
class Delta:
    added: set[int] = field(default_factory=set)      # blocks newly mapped by a request
    removed: set[int] = field(default_factory=set)    # blocks a finished / preempted request let go
    released: dict[str, list[int]] = field(default_factory=dict)   # request -> blocks it let go
    edge: set[int] = field(default_factory=set)       # scheduled requests' oldest blocks still in a window
    freed: set[int] = field(default_factory=set)      # released blocks no request holds any more (then)

    def touched(self) -> set[int]:
        return self.added | self.removed | self.edge


def cached_rows(so):
    """(request, its new block ids per group or None, computed tokens, resumed?) for each running or
    resumed request of a SchedulerOutput (CachedRequestData's parallel lists, read by index)."""
    c = getattr(so, "scheduled_cached_reqs", None)
    if c is None:
        return
    resumed = set(getattr(c, "resumed_req_ids", None) or ())
    new_ids = c.new_block_ids
    n = len(new_ids)
    for i, (rid, computed) in enumerate(zip(c.req_ids, c.num_computed_tokens)):
        yield rid, (new_ids[i] if i < n else None), int(computed), rid in resumed


def grown_rows(so):
    """(request, its new block ids per group, resumed?) for the rows of CachedRequestData that got
    blocks in this SchedulerOutput: a decode step's few, without a tuple for every running row."""
    c = getattr(so, "scheduled_cached_reqs", None)
    if c is None:
        return ()
    resumed = set(getattr(c, "resumed_req_ids", None) or ())
    return ((rid, new, rid in resumed) for rid, new in zip(c.req_ids, c.new_block_ids) if new)


def whole_lists(so):
    """(request, its block ids per group, computed tokens) for each request that got its whole block
    list in this SchedulerOutput: new requests and resumed ones (their computed tokens: a prefix hit)."""
    for nr in getattr(so, "scheduled_new_reqs", None) or ():
        yield nr.req_id, nr.block_ids, int(nr.num_computed_tokens)
    c = getattr(so, "scheduled_cached_reqs", None)
    if c is None or not getattr(c, "resumed_req_ids", None):
        return                                    # no resumed request: the running rows need no walk
    for rid, new, computed, resumed in cached_rows(so):
        if resumed:
            yield rid, new or (), computed


class BlockLedger:
    def __init__(self, num_blocks: int | None = None, rules: list[GroupRule] | None = None,
                 block_sizes: list[int] | None = None, null_block: int | None = None):
        self.reqs: dict[str, Entry] = {}
        self.last_holder: dict[int, str] = {}
        self.steps = 0
        self.rules = list(rules or [])
        self.block_sizes = list(block_sizes or [])
        self.null = null_block
        self.counts = None if num_blocks is None else np.zeros(num_blocks, dtype=np.int64)
        self.optional = None if num_blocks is None else np.zeros(num_blocks, dtype=np.int64)
        self._after: dict[int, dict[str, int]] = {}     # id(SchedulerOutput) -> processed tokens when done
        self._has_window = None                         # _windowed(), once

    def _count(self, arr, blocks, by: int) -> None:
        if arr is None or not blocks:
            return
        idx = np.asarray([b for b in blocks if 0 <= b < len(arr) and b != self.null], dtype=np.int64)
        np.add.at(arr, idx, by)

    def _map(self, rid: str, groups, delta: Delta, replace: bool) -> None:
        e = self.reqs.get(rid)
        if e is None or replace:
            if e is not None:
                self._release(rid, delta)
            e = self.reqs[rid] = Entry([[] for _ in groups], floor=[0] * len(groups))
        while len(e.groups) < len(groups):
            e.groups.append([])
            e.floor.append(0)
        for g, ids in enumerate(groups):
            if not ids:
                continue
            ids = [int(b) for b in ids]
            e.groups[g].extend(ids)
            if not self._counted(g):
                continue
            self._count(self.counts, ids, 1)
            for b in ids:
                if b != self.null:
                    delta.added.add(b)
                    self.last_holder[b] = rid

    def _windowed(self) -> bool:
        """Whether a modelled group has a window (its floors move as tokens are processed)."""
        w = self._has_window
        if w is None:
            w = self._has_window = any(r.kind not in ("full", "unmodelled") for r in self.rules)
        return w

    def _counted(self, g: int) -> bool:
        return g >= len(self.rules) or self.rules[g].kind != "unmodelled"

    def _advance(self, e: Entry, delta: Delta) -> None:
        """Blocks that left a group's window move from must-hold to may-have-freed; the new edge is
        touched. Recomputed with the group's own rule from the tokens whose step is done: vLLM frees
        on that basis (computed minus in flight), so a block an in-flight step still reads stays
        must-hold under async scheduling too."""
        for g, rule in enumerate(self.rules[:len(e.groups)]):
            if rule.kind in ("full", "unmodelled"):
                continue
            blocks = e.groups[g]
            bs = self.block_sizes[g]
            new = min(rule.skipped(e.processed) // bs, len(blocks))
            old = e.floor[g]
            if new > old:                      # vLLM never takes a freed window block back
                moved = blocks[old:new]
                self._count(self.counts, moved, -1)
                self._count(self.optional, moved, 1)
                e.floor[g] = new
            if e.floor[g] < len(blocks) and blocks[e.floor[g]] != self.null:
                delta.edge.add(blocks[e.floor[g]])

    def _release(self, rid: str, delta: Delta) -> None:
        e = self.reqs.pop(rid, None)
        if e is None:
            return
        blocks = [b for ids in e.groups for b in ids if b != self.null]
        for b in blocks:                    # the last request to map or let go of a block names it
            self.last_holder[b] = rid
        delta.released[rid] = blocks
        delta.removed.update(blocks)
        for g, ids in enumerate(e.groups):
            if not self._counted(g):
                continue
            f = e.floor[g] if g < len(e.floor) else 0
            self._count(self.optional, ids[:f], -1)
            self._count(self.counts, ids[f:], -1)
        if self.counts is not None:
            n = len(self.counts)
            delta.freed.update(b for b in blocks if 0 <= b < n and self.counts[b] + self.optional[b] <= 0)

    def apply(self, so) -> Delta:
        """One SchedulerOutput, in the order vLLM's workers apply it."""
        d = Delta()
        self.steps += 1
        for rid in getattr(so, "finished_req_ids", None) or ():
            self._release(rid, d)
        for rid in getattr(so, "preempted_req_ids", None) or ():
            self._release(rid, d)
        sched = getattr(so, "num_scheduled_tokens", None) or {}
        after: dict[str, int] = {}             # request -> tokens processed once this output's step is done
        for nr in getattr(so, "scheduled_new_reqs", None) or ():
            self._map(nr.req_id, nr.block_ids, d, replace=True)
            e = self.reqs[nr.req_id]
            e.computed, e.scheduled = int(nr.num_computed_tokens), int(sched.get(nr.req_id, 0))
            e.processed = e.computed           # its prefix hit: done before any step
            after[nr.req_id] = e.computed + e.scheduled
            self._advance(e, d)
        windowed = self._windowed()
        reqs, get = self.reqs, sched.get
        # the running requests (a decode step of 256 requests is 256 rows; most get no new block):
        # no per-row rule walk unless a group has a window
        for rid, new, computed, is_resumed in cached_rows(so):
            if is_resumed:
                self._map(rid, new or (), d, replace=True)
            elif new:
                self._map(rid, new, d, replace=False)
            e = reqs.get(rid)
            if e is None:                      # a running request the ledger never saw added
                e = reqs[rid] = Entry([])
            e.computed, e.scheduled = computed, int(get(rid, 0))
            if is_resumed:
                e.processed = e.computed
            if windowed:
                after[rid] = e.computed + e.scheduled
                self._advance(e, d)
        if windowed:
            self._after[id(so)] = after
            while len(self._after) > 64:       # outputs whose results never came back: bounded
                self._after.pop(next(iter(self._after)))
        return d

    def done(self, so) -> Delta:
        """The step of this SchedulerOutput is done (update_from_output returned): its tokens count as
        processed, and window floors move on."""
        d = Delta()
        for rid, n in (self._after.pop(id(so), None) or {}).items():
            e = self.reqs.get(rid)
            if e is not None and n > e.processed:
                e.processed = n
                self._advance(e, d)
        return d

    def finish(self, rids) -> Delta:
        """Requests the engine core has finished (or aborted) but not yet reported in an output."""
        d = Delta()
        for rid in rids:
            self._release(rid, d)
        return d

    def holders(self, group: int | None = None, optional: bool = False) -> dict[str, list[int]]:
        """Request -> the blocks it must hold (optional=True: those it may have let go instead)."""
        out = {}
        for r, e in self.reqs.items():
            sel = range(len(e.groups)) if group is None else [group] if group < len(e.groups) else []
            sel = [g for g in sel if self._counted(g)]
            blocks = []
            for g in sel:
                f = e.floor[g] if g < len(e.floor) else 0
                part = e.groups[g][:f] if optional else e.groups[g][f:]
                blocks += [b for b in part if b != self.null]
            if blocks or not optional:
                out[r] = blocks
        return out

    def who(self, block: int) -> list[tuple[str, int, int]]:
        """(request, group, index) for each place a block must still be held (a scan: for naming the
        few blocks a finding is about); where none must, those that may have let it go."""
        at = [(r, g, i, i >= (e.floor[g] if g < len(e.floor) else 0)) for r, e in self.reqs.items()
              for g, ids in enumerate(e.groups) if self._counted(g) for i, b in enumerate(ids) if b == block]
        must = [(r, g, i) for r, g, i, m in at if m]
        return must or [(r, g, i) for r, g, i, _ in at]
