"""Open a recording: a recorder directory (even one a killed process left) or a frozen bundle.

Every complete line of every segment is read; a torn last line (the tail a SIGKILL cut) is
skipped and counted; a corrupt line or a segment without its header is a RecordingError naming
the file and line with `strict=True`, and otherwise skipped, counted in `skipped` and named in
`problems`, so the rest opens. Only the event types the workbench defines are rebuilt (by
name, from a fixed table): nothing in a recording is executed or unpickled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..events import EVENT_BY_NAME
from .ring import SCHEMA, SEGMENT_PREFIX


class RecordingError(ValueError):
    """A recording that cannot be read as asked; the message names the file (and line)."""


@dataclass
class Recording:
    path: Path
    header: dict
    requests: list[dict] = field(default_factory=list)
    events: list[tuple[str, dict]] = field(default_factory=list)      # (event type name, fields), in order
    findings: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)                   # vLLM recordings: one row per step
    segments: list[str] = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def block_size(self) -> int:
        return int(self.header.get("block_size") or 16)

    @property
    def num_blocks(self) -> int:
        return int(self.header.get("num_blocks") or 0)

    def trace(self):
        """The recorded requests as a Trace (the format read_trace returns for any trace file)."""
        from ..trace.schema import Trace, TraceRecord
        recs = []
        for r in sorted(self.requests, key=lambda r: r.get("arrival_s", 0.0)):
            ids = r.get("prompt_token_ids")
            plen = len(ids) if ids is not None else int(r.get("prompt_len") or 0)
            recs.append(TraceRecord(r.get("id"), float(r.get("arrival_s") or 0.0), int(r.get("output_len") or 1), plen,
                                    ids, None, r.get("hash_ids"), r.get("hash_block_size"), r.get("sampling") or {}))
        return Trace(recs, str(self.path), "recording", dict(self.skipped))

    def event_log(self):
        """The recorded events in an EventLog, as the live engine's would hold them."""
        from ..events import EventLog
        log = EventLog(max_rows=None)
        for name, fields in self.events:
            t = EVENT_BY_NAME[name]
            log.record(t(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}))
        return log

    def time_travel(self):
        from ..trace.timetravel import TimeTravel
        return TimeTravel(self.event_log(), self.num_blocks)

    def frame(self, what: str = "requests"):
        import pandas as pd
        if what == "requests":
            return pd.DataFrame(self.requests)
        if what == "findings":
            return pd.DataFrame(self.findings)
        if what == "steps":
            return pd.DataFrame(self.steps or [f for n, f in self.events if n == "StepFinished"])
        raise ValueError(f"frame({what!r}): one of 'requests', 'findings', 'steps'")


def is_recording(path) -> bool:
    p = Path(path)
    return p.is_dir() and any(p.glob(f"{SEGMENT_PREFIX}*.jsonl"))


def open_recording(path, strict: bool = False) -> Recording:
    root = Path(path)
    if not root.exists():
        raise RecordingError(f"{root}: no such recording")
    segs = sorted(root.glob(f"{SEGMENT_PREFIX}*.jsonl"))
    if not root.is_dir() or not segs:
        raise RecordingError(f"{root}: not a recording (a directory of {SEGMENT_PREFIX}*.jsonl segments)")
    rec = Recording(root, {})

    def bad(msg: str, what: str) -> None:
        if strict:
            raise RecordingError(msg)
        rec.problems.append(msg)
        rec.skipped[what] = rec.skipped.get(what, 0) + 1

    for seg in segs:
        lines = seg.read_bytes().split(b"\n")
        torn = lines[-1] != b""                  # no newline at the end: cut mid-write
        if not torn:
            lines = lines[:-1]
        header = None
        for i, raw in enumerate(lines, start=1):
            last = i == len(lines)
            try:
                obj = json.loads(raw)
                if not isinstance(obj, dict):
                    raise ValueError(f"a JSON {type(obj).__name__}, not an object")
            except ValueError as e:
                if last and torn:
                    rec.skipped["torn_last_line"] = rec.skipped.get("torn_last_line", 0) + 1
                else:
                    bad(f"{seg}:{i}: not a recording line ({str(e)[:80]})", "corrupt_lines")
                continue
            if i == 1:
                if obj.get("k") != "header" or obj.get("schema") != SCHEMA:
                    bad(f"{seg}:1: no {SCHEMA} header (found {str(obj)[:80]}); segment skipped", "segments_without_header")
                    break
                header = obj
                if not rec.header:
                    rec.header = {k: v for k, v in obj.items() if k not in ("k", "segment", "opened")}
                rec.segments.append(seg.name)
                continue
            kind = obj.get("k")
            if kind == "request":
                rec.requests.append(obj)
            elif kind == "ev":
                name = obj.get("e")
                if name not in EVENT_BY_NAME:
                    bad(f"{seg}:{i}: unknown event type {name!r}", "unknown_events")
                    continue
                rec.events.append((name, {k: v for k, v in obj.items() if k not in ("k", "e")}))
            elif kind == "finding":
                rec.findings.append(obj)
            elif kind == "step":
                rec.steps.append(obj)
            else:
                bad(f"{seg}:{i}: unknown record kind {kind!r}", "unknown_records")
        if header is None and seg.name not in rec.segments and not any(str(seg) in p for p in rec.problems):
            bad(f"{seg}: empty segment", "segments_without_header")
    if not rec.segments:
        raise RecordingError(f"{root}: no segment could be read: {'; '.join(rec.problems[:3])}")
    return rec
