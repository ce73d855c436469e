"""EventLog: every event the bus carries, kept in columns (one table per event type), bounded,
with spill to Parquet; frame() gives a type's events as a DataFrame. Split from events.py (the
typed events and the bus), which re-exports it."""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Iterable

from .events import EVENT_BY_NAME, EVENT_TYPES, Event, EventBus, _row_getter

# ---- the log ---------------------------------------------------------------
# tensors and whole prompts stay out of the log (the trace capture keeps prompts)
_SKIP_COLUMNS = {"cu_seqlens_q", "cu_seqlens_k", "slot_mapping", "prompt_token_ids", "params", "output_token_ids"}


def _plain(v: Any) -> Any:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if isinstance(v, tuple):
        return v
    return str(v)


_PLAIN_TYPES = frozenset({int, float, str, bool, type(None)})    # _plain(v) is v: the common case, one lookup
_KEPT_TYPES = _PLAIN_TYPES | {tuple}
_PLAIN_NAMES = frozenset({"int", "float", "str", "bool", "None", "tuple"})


def _plain_annotation(annotation) -> bool:
    """A field declared int, float, str, bool, None or tuple (or a union of them)."""
    names = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return all(part.strip() in _PLAIN_NAMES for part in str(names).split("|"))


class EventLog:
    """Every event in columns (one table per event type), bounded, with spill to Parquet.

    When a type's table passes max_rows, its oldest half goes to a Parquet file in
    spill_dir (or is dropped and counted, without one). frame() reads spills back,
    so the past stays whole as long as it was spilled. max_rows=None: unbounded.

    record() is the hot path of a replay (a million events): it keeps each event's
    values as one row tuple; `tables` turns the rows into columns when read (one
    transposition per type in C), so a row costs an append, not an append per field.
    """

    def __init__(self, bus: EventBus | None = None, types: Iterable[type] = EVENT_TYPES,
                 max_rows: int | None = 1_000_000, spill_dir: str | None = None):
        self.max_rows = max_rows
        self.spill_dir = spill_dir
        self._tables: dict[type, dict[str, list]] = {}
        self.spilled: dict[type, list[str]] = {}
        self.dropped = 0
        self.seq = 0                      # global order across types
        import threading
        self._lock = threading.RLock()    # lock events arrive from other threads; readers hold it over `tables`
        self._types = tuple(types)
        self._fields = {t: [f.name for f in dataclasses.fields(t) if f.name not in _SKIP_COLUMNS]
                        for t in self._types}
        # Types whose every kept field is declared a plain value or a tuple of them keep rows as
        # they come (immutable, converted when read); the others convert each value on arrival,
        # so a mutable object cannot change in the log after the event.
        self._deferred = {t for t in self._types
                          if all(_plain_annotation(f.type) for f in dataclasses.fields(t) if f.name not in _SKIP_COLUMNS)}
        self._pending: dict[type, tuple] = {}      # type -> (seqs, rows, row picker: None keeps the row)
        self._counts: dict[type, int] = {}         # rows held in memory per type (columns + pending)
        self.bus = None
        if bus is not None:
            self.attach(bus)

    def attach(self, bus: EventBus) -> None:
        self.bus = bus
        bus.subscribe_rows(self._types, self.record_row, many=self.record_rows)

    def detach(self) -> None:
        if self.bus is not None:
            self.bus.unsubscribe(self.record_row)
            self.bus = None

    def record(self, e: Event) -> None:
        t = type(e)
        self.record_row(t, _row_getter(t)[0](e))

    def record_row(self, t: type, row: tuple) -> None:
        """record() of an event given as its field values (EventBus.subscribe_rows)."""
        with self._lock:
            self._keep(t, row)

    def record_rows(self, items: list[tuple[type, tuple]]) -> None:
        """record_row of each (type, row), in order, under one hold of the lock (EventBus.emit_rows):
        grouped by type first, so each type's pending rows grow by one extend (a forward's 2L rows)."""
        with self._lock:
            seq = self.seq
            self.seq = seq + len(items)
            groups: dict = {}
            for t, row in items:
                g = groups.get(t)
                if g is None:
                    g = groups[t] = ([], [])
                g[0].append(seq)
                g[1].append(row)
                seq += 1
            for t, (seqs, rows) in groups.items():
                pend = self._pending.get(t)
                if pend is None:
                    pend = self._new_pending(t)
                pend[0].extend(seqs)
                pend[1].extend(rows if pend[2] is None else map(pend[2], rows))
                self._counts[t] += len(rows)
                while self.max_rows is not None and self._counts[t] > max(self.max_rows, 1):   # halves until under
                    self._spill(t, self._flush(t))

    def _keep(self, t: type, row: tuple) -> None:
        """One row into t's pending rows (the lock held)."""
        pend = self._pending.get(t)
        if pend is None:
            pend = self._new_pending(t)
        pend[0].append(self.seq)
        self.seq += 1
        pend[1].append(row if pend[2] is None else pend[2](row))
        n = self._counts[t] = self._counts[t] + 1
        if self.max_rows is not None and n > self.max_rows:
            self._spill(t, self._flush(t))

    def _new_pending(self, t: type) -> tuple:
        fields = self._fields[t]
        # A full row keeps the fields the log keeps, in order: as it is when that is all of them.
        names = [f.name for f in dataclasses.fields(t)]
        keep = [names.index(f) for f in fields]
        pick = None
        if keep != list(range(len(names))):
            pick = (operator.itemgetter(*keep) if len(keep) > 1 else (lambda r, _i=keep[0]: (r[_i],)))
        if t not in self._deferred:
            pick = ((lambda r: tuple(map(_plain, r))) if pick is None
                    else (lambda r, _p=pick: tuple(map(_plain, _p(r)))))
        self._counts.setdefault(t, 0)
        pend = self._pending[t] = ([], [], pick)
        return pend

    def _flush(self, t: type) -> dict[str, list]:
        """Move t's pending rows into its columns; returns the columns."""
        fields = self._fields[t]
        cols = self._tables.get(t)
        if cols is None:
            cols = self._tables[t] = {"seq": [], **{f: [] for f in fields}}
        pend = self._pending.get(t)
        if pend is not None and pend[0]:
            seqs, rows = pend[0], pend[1]
            cols["seq"].extend(seqs)
            for f, values in zip(fields, zip(*rows)):
                if set(map(type, values)) <= _KEPT_TYPES:       # the common case: kept as they came
                    cols[f].extend(values)
                else:
                    cols[f].extend(map(_plain, values))
            seqs.clear()
            rows.clear()
        return cols

    @property
    def tables(self) -> dict[type, dict[str, list]]:
        """One dict of columns per event type ("seq" and the event's fields, plain values and tuples)."""
        with self._lock:
            todo = [t for t, pend in self._pending.items() if pend[0]]
            if todo:
                # A replay's million rows become millions of small lists at once; they make no
                # cycles, and the cyclic collector would rescan them again and again meanwhile.
                import gc
                was_on = gc.isenabled()
                gc.disable()
                try:
                    for t in todo:
                        self._flush(t)
                finally:
                    if was_on:
                        gc.enable()
            return self._tables

    def _spill(self, t: type, cols: dict[str, list]) -> None:
        half = len(cols["seq"]) // 2
        if self.spill_dir is not None:
            import os
            import pandas as pd
            os.makedirs(self.spill_dir, exist_ok=True)
            path = os.path.join(self.spill_dir, f"{t.__name__}-{len(self.spilled.get(t, []))}.parquet")
            pd.DataFrame({k: v[:half] for k, v in cols.items()}).to_parquet(path)
            self.spilled.setdefault(t, []).append(path)
        else:
            self.dropped += half
        for k in cols:
            del cols[k][:half]
        self._counts[t] = len(cols["seq"])

    def __len__(self) -> int:
        return sum(self._counts.values())

    def frame(self, etype: type | str | None = None):
        """A pandas DataFrame of one event type, or of all (columns: seq, event, step, t_ns, ...)."""
        import pandas as pd
        if isinstance(etype, str):
            etype = EVENT_BY_NAME[etype]
        types = [etype] if etype is not None else [t for t in self._types if t in self.tables or t in self.spilled]
        frames = []
        for t in types:
            parts = [pd.read_parquet(p) for p in self.spilled.get(t, [])]
            if t in self.tables:
                parts.append(pd.DataFrame(self.tables[t]))
            if parts:
                df = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]
                df.insert(1, "event", t.__name__)
                frames.append(df)
        if not frames:
            cols = ["seq", "event", "step", "t_ns"] + ([f for f in self._fields[etype] if f not in ("step", "t_ns")]
                                                      if etype is not None else [])
            return pd.DataFrame(columns=cols)
        df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        return df.sort_values("seq", kind="stable").reset_index(drop=True)

    def events(self, etype: type) -> Iterable[Event]:
        """Rebuild event objects of one type, in order (from memory only)."""
        cols = self.tables.get(etype)
        if not cols:
            return []
        names = self._fields[etype]
        return [etype(**{n: cols[n][i] for n in names}) for i in range(len(cols["seq"]))]
