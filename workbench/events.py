"""Typed engine events and the bus they travel on (the EventLog that keeps them: event_log.py, above this one).

The engine emits; probes, the log and widgets subscribe. Emission sites are written

    if bus.wants(PagesAllocated):
        bus.emit(PagesAllocated(...))

so an event type nobody subscribes to costs one set lookup and allocates nothing.
"""
from __future__ import annotations

import dataclasses
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

now_ns = time.perf_counter_ns


@dataclass(slots=True)
class Event:
    step: int
    t_ns: int


# ---- requests --------------------------------------------------------------
@dataclass(slots=True)
class RequestSubmitted(Event):
    """add_request accepted a request (emitted on the caller's thread before it returns)."""
    request_id: int
    user_request_id: Any
    prompt_token_ids: Any          # the prompt's token ids (not copied: do not mutate)
    params: Any                    # its SamplingParams
    arrival_time: float            # time.perf_counter() when it arrived


@dataclass(slots=True)
class RequestArrived(Event):
    request_id: int
    prompt_len: int
    max_tokens: int


@dataclass(slots=True)
class RequestAdmitted(Event):
    request_id: int
    num_cached_tokens: int
    num_pages: int


@dataclass(slots=True)
class RequestRejected(Event):
    request_id: int | None
    prompt_len: int
    reason: str


@dataclass(slots=True)
class RequestPreempted(Event):
    request_id: int
    num_pages_freed: int
    num_computed_tokens: int


@dataclass(slots=True)
class RequestFinished(Event):
    request_id: int
    reason: str
    prompt_len: int
    output_len: int
    num_preemptions: int
    ttft_s: float | None
    latency_s: float | None
    output_token_ids: Any = ()     # what it produced (the flight recorder keeps it: a recording is a triage side)


# ---- pages -----------------------------------------------------------------
@dataclass(slots=True)
class PagesAllocated(Event):
    pages: tuple
    generations: tuple
    request_id: int | None = None     # the sequence the pages went to


@dataclass(slots=True)
class PagesFreed(Event):
    pages: tuple          # pages whose refcount reached zero
    request_id: int | None = None     # the sequence that let go
    cached: tuple = ()    # of `pages`, those that keep their prefix hash (cached-free, reusable)
    still_shared: tuple = ()          # pages this sequence let go that others still map


@dataclass(slots=True)
class PagesShared(Event):
    pages: tuple          # a prefix-cache hit took one more reference
    request_id: int | None = None


@dataclass(slots=True)
class PagesEvicted(Event):
    pages: tuple          # cached-free pages whose prefix hash was dropped for reuse


@dataclass(slots=True)
class PagesRegistered(Event):
    pages: tuple          # full pages just entered in the prefix cache
    page_indices: tuple   # each page's index in the registering sequence (its position / page_size)
    request_id: int | None = None     # the sequence whose K/V the pages hold


# ---- the step --------------------------------------------------------------
@dataclass(slots=True)
class BlockTableBound(Event):
    version: int
    checksum: int
    num_rows: int
    width: int


@dataclass(slots=True)
class BatchPacked(Event):
    request_ids: tuple
    query_lens: tuple
    context_lens: tuple
    num_tokens: int
    num_prefill: int
    num_decode: int
    cu_seqlens_q: Any = None       # the tensors as packed, for probes that check them
    cu_seqlens_k: Any = None
    slot_mapping: Any = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0


@dataclass(slots=True)
class AttentionRead(Event):
    layer: int
    block_table_version: int      # the version the kernel read
    block_table_checksum: int     # checksum of the rows it read
    bytes_read: int


@dataclass(slots=True)
class KVWritten(Event):
    layer: int
    k_absmax: float               # measured before the cast to the cache dtype
    v_absmax: float
    num_tokens: int


@dataclass(slots=True)
class StepFinished(Event):
    duration_ns: int
    num_tokens: int
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    bytes_weights: int
    bytes_kv_read: int
    bytes_kv_written: int
    pages_used: int
    pages_cached: int
    num_running: int
    num_waiting: int
    num_preemptions: int


@dataclass(slots=True)
class StepFailed(Event):
    """Engine.step raised (the exception goes on to the caller): what the flight recorder freezes on."""
    error: str


@dataclass(slots=True)
class EngineIdle(Event):
    """The engine has nothing left to run (no request running, waiting or queued)."""
    pages_used: int
    pages_cached: int


@dataclass(slots=True)
class RankStepFinished(Event):
    """One rank's share of a tensor-parallel step (workbench/engine/parallel), reported to rank 0."""
    rank: int
    duration_ns: int              # the rank's forward, from receiving the plan to its report
    comm_ns: int                  # of which inside collectives (waiting for the slowest rank included)
    bytes: int                    # weights, KV pages read and K/V written by this rank (its shard)
    comm_bytes: int               # bytes this rank handed to the collectives
    table_crc: int                # crc32 of the block table bytes this rank bound
    table_version: int            # its BlockTables.version
    num_rows: int
    width: int


# ---- locks -----------------------------------------------------------------
@dataclass(slots=True)
class LockWaited(Event):
    lock: str
    thread: str
    site: str
    wait_ns: int


@dataclass(slots=True)
class LockHeld(Event):
    lock: str
    thread: str
    site: str
    hold_ns: int


# ---- a watched vLLM (workbench/adapters/vllm): step = vLLM's step, batch seq or scrape ----------------
@dataclass(slots=True)
class VllmStepChecked(Event):
    """The plugin checked one vLLM step (engine-core side) and sent its pool snapshot."""
    num_blocks: int
    num_free: int
    running: int
    waiting: int
    hashed: int                   # blocks carrying a prefix hash
    step_ns: int | None           # the step's own time (None: not known, e.g. an idle sweep's row)
    check_ns: int | None          # the plugin's time on it (None: not known)


@dataclass(slots=True)
class VllmBlocksStored(Event):
    """A KV event: blocks entered vLLM's prefix cache (step: the event batch's sequence number)."""
    block_hashes: tuple
    num_tokens: int


@dataclass(slots=True)
class VllmBlocksRemoved(Event):
    block_hashes: tuple


@dataclass(slots=True)
class VllmMetricsScraped(Event):
    """One scrape of vLLM's /metrics (step: the scrape's index)."""
    kv_cache_usage: float | None
    running: float | None
    waiting: float | None
    preemptions: float | None
    prefix_queries: float | None
    prefix_hits: float | None


EVENT_TYPES: tuple[type, ...] = (
    RequestSubmitted, RequestArrived, RequestAdmitted, RequestRejected, RequestPreempted, RequestFinished,
    PagesAllocated, PagesFreed, PagesShared, PagesEvicted, PagesRegistered,
    BlockTableBound, BatchPacked, AttentionRead, KVWritten, StepFinished, StepFailed, EngineIdle, RankStepFinished,
    LockWaited, LockHeld,
    VllmStepChecked, VllmBlocksStored, VllmBlocksRemoved, VllmMetricsScraped,
)
EVENT_BY_NAME = {t.__name__: t for t in EVENT_TYPES}


class EventBus:
    """Synchronous publish/subscribe keyed by event type.

    Two kinds of subscriber: fn(event), and row subscribers, fn(etype, row) with row the event's
    field values in declaration order (subscribe_rows). A producer that has the values at hand
    (the page pool: a million events in a replay) emits them with emit_row(), and the event
    object is built only when someone takes objects; a consumer that stores rows (the
    EventLog) never needs one.
    """

    def __init__(self) -> None:
        self._subs: dict[type, list[Callable[[Event], None]]] = {}
        self._row_subs: dict[type, list[Callable[[type, tuple], None]]] = {}
        self._many: dict[Callable, Callable[[list], None]] = {}    # row subscriber -> its handler of many rows
        self._wanted: frozenset[type] = frozenset()
        self.on_error: Callable[[Callable, Event, BaseException], None] | None = None
        self.on_change: list[Callable[[], None]] = []     # told when the set of wanted types changes

    def wants(self, etype: type) -> bool:
        return etype in self._wanted

    def subscribe(self, etypes: type | Iterable[type], fn: Callable[[Event], None]) -> None:
        for t in ([etypes] if isinstance(etypes, type) else etypes):
            self._subs.setdefault(t, []).append(fn)
        self._changed()

    def subscribe_rows(self, etypes: type | Iterable[type], fn: Callable[[type, tuple], None],
                       many: Callable[[list], None] | None = None) -> None:
        """fn(etype, row) for every event of these types; row: its field values in declaration order.
        many: also takes a list of (etype, row) in one call, what emit_rows hands it."""
        for t in ([etypes] if isinstance(etypes, type) else etypes):
            _row_getter(t)                              # a type that is not a dataclass fails here, not later
            self._row_subs.setdefault(t, []).append(fn)
        if many is not None:
            self._many[fn] = many
        self._changed()

    def unsubscribe(self, fn: Callable) -> None:
        for fs in (*self._subs.values(), *self._row_subs.values()):
            while fn in fs:
                fs.remove(fn)
        self._many.pop(fn, None)
        self._changed()

    def _changed(self) -> None:
        self._wanted = frozenset(t for subs in (self._subs, self._row_subs) for t, fs in subs.items() if fs)
        for cb in self.on_change:
            cb()

    def emit(self, event: Event) -> None:
        t = type(event)
        rows = self._row_subs.get(t)
        if rows:
            self._deliver(rows, (t, _row_getter(t)[0](event)), event)
        subs = self._subs.get(t)
        if subs:
            self._deliver(subs, (event,), event)

    def emit_row(self, etype: type, row: tuple) -> None:
        """emit(etype(*row)), building the event only for subscribers that take objects.
        row must hold every field (a shorter one, relying on defaults, is built and emitted)."""
        if len(row) != _row_getter(etype)[1]:
            self.emit(etype(*row))
            return
        rows = self._row_subs.get(etype)
        if rows:
            self._deliver(rows, (etype, row), None)
        subs = self._subs.get(etype)
        if subs:
            event = etype(*row)
            self._deliver(subs, (event,), event)

    def emit_rows(self, items: list[tuple[type, tuple]]) -> None:
        """emit_row(etype, row) of each item, in order. A row subscriber that gave subscribe_rows a
        `many` handler gets its items in one call, in order, after the others have had each (the event
        log: one lock for a forward's per-layer rows, not one per row); the others as emit_row gives them."""
        many = self._many
        one = self._one_batch_taker(items)
        if one is not None:                       # every item goes to the same handlers of many, and only there
            for fn in one:
                self._deliver_many(fn, many.get(fn), items)
            return
        batches: dict = {}
        for t, row in items:
            if len(row) != _row_getter(t)[1]:
                self.emit(t(*row))
                continue
            for fn in self._row_subs.get(t, ()):
                if fn in many:
                    batches.setdefault(fn, []).append((t, row))
                else:
                    self._deliver((fn,), (t, row), None)
            subs = self._subs.get(t)
            if subs:
                event = t(*row)
                self._deliver(subs, (event,), event)
        for fn, got in batches.items():
            self._deliver_many(fn, many.get(fn), got)

    def _one_batch_taker(self, items: list) -> list | None:
        """The row subscribers of every item's type when they are the same handlers of many for all of
        them, no one takes objects, and every row is whole (the event log alone listening to a forward's
        per-layer rows): emit_rows then hands them the list as it is, no pass per row. Else None."""
        types = set(map(_first, items))
        first = None
        for t in types:
            fns = self._row_subs.get(t)
            if not fns or self._subs.get(t):
                return None
            if first is None:
                if not all(fn in self._many for fn in fns):
                    return None
                first = fns
            elif fns != first:
                return None
        if first is None:
            return None
        width = {t: _row_getter(t)[1] for t in types}
        if any(len(row) != width[t] for t, row in items):
            return None
        return list(first)

    def _deliver_many(self, fn, handler, got: list) -> None:
        if handler is None:                   # unsubscribed meanwhile (another thread): one at a time
            for t, row in got:
                self._deliver((fn,), (t, row), None)
            return
        try:
            handler(got)
        except Exception as e:
            if self.on_error is None:
                raise
            t, row = got[0]
            self.on_error(fn, t(*row), e)

    def _deliver(self, fns, args: tuple, event) -> None:
        """fn(*args) for each subscriber; a subscriber never breaks the engine: its error goes to
        on_error with the event (None: built from args = (etype, row), only then)."""
        for fn in fns:
            try:
                fn(*args)
            except Exception as e:
                if self.on_error is None:
                    raise
                self.on_error(fn, event if event is not None else args[0](*args[1]), e)


_ROW_GETTERS: dict[type, tuple] = {}
_first = operator.itemgetter(0)


def _row_getter(t: type) -> tuple:
    """(event -> its field values as a tuple, number of fields) for an event dataclass."""
    got = _ROW_GETTERS.get(t)
    if got is None:
        names = [f.name for f in dataclasses.fields(t)]
        get = operator.attrgetter(*names) if len(names) > 1 else (lambda e, _n=names[0]: (getattr(e, _n),))
        got = _ROW_GETTERS[t] = (get, len(names))
    return got


