"""LogTail: the rows of one event type added to an EventLog since the last read.

Live views refresh several times a second; rebuilding a DataFrame of the whole history
each time would cost O(history) per refresh. The log keeps columns as lists ordered by
`seq`, so the new rows are a bisect and a slice away. Rows spilled to Parquet before
the first read are loaded once through frame().
"""
from __future__ import annotations

import bisect
import contextlib


class LogTail:
    def __init__(self, log, etype: type, fields: list[str]):
        self.log, self.etype, self.fields = log, etype, list(fields)
        self.seq = -1                       # the last seq handed out

    def read(self) -> dict[str, list]:
        log, t = self.log, self.etype
        if log is None:
            return {f: [] for f in self.fields}
        if self.seq < 0 and getattr(log, "spilled", {}).get(t):
            df = log.frame(t)
            if not len(df):
                return {f: [] for f in self.fields}
            self.seq = int(df["seq"].iloc[-1])
            return {f: (df[f].tolist() if f in df else [None] * len(df)) for f in self.fields}
        with getattr(log, "_lock", None) or contextlib.nullcontext():
            cols = log.tables.get(t)
            if not cols or not cols["seq"] or cols["seq"][-1] <= self.seq:
                return {f: [] for f in self.fields}
            i = bisect.bisect_right(cols["seq"], self.seq)
            out = {f: (cols[f][i:] if f in cols else [None] * (len(cols["seq"]) - i)) for f in self.fields}
            self.seq = cols["seq"][-1]
        return out
