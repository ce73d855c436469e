"""A bounded ring of JSONL segments on disk: what a recording is made of.

A recording is a directory of segments `seg-000001.jsonl`, `seg-000002.jsonl`, ... Each
segment opens with a header line (the schema version, what wrote it, the engine and model
config, block and pool size, versions) so that any one segment, found alone, says what it
holds. Records follow, one JSON object a line, `{"k": kind, ...}`. Plain JSON: nothing a
user opens is ever unpickled.

Bounded: a segment is closed at `segment_bytes` and a new one opened; when the segments
together pass `max_bytes`, the oldest is deleted (the ring's window moves on). Crash-safe:
records are written through at each `flush()` (the recorders call it once per engine step,
and at most `flush_s` apart), so a SIGKILL loses at most the records since the last flush:
one step. A torn last line is skipped (and counted) by the reader; every complete line opens.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("workbench.recorder")

try:            # vLLM's environment has msgspec (a vLLM requirement): ~10x json.dumps on a step's records
    import msgspec
    _PLAIN_ENCODER = msgspec.json.Encoder()
except ImportError:                     # not a requirement of ours: json.dumps then
    _PLAIN_ENCODER = None

SCHEMA = "kvwb-recording/1"
DEFAULT_MAX_BYTES = 256 * 2**20
SEGMENT_PREFIX = "seg-"


def _segments(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(f"{SEGMENT_PREFIX}*.jsonl") if p.is_file())


class SegmentRing:
    def __init__(self, root: str | Path, header: dict, max_bytes: int = DEFAULT_MAX_BYTES,
                 segment_bytes: int | None = None, flush_s: float = 1.0):
        if not isinstance(max_bytes, int) or max_bytes < 4096:
            raise ValueError(f"max_bytes={max_bytes!r}: a recording needs at least 4096 bytes")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or max(2048, max_bytes // 8)
        self.flush_s = flush_s
        self.header = {"schema": SCHEMA, **header}
        self._lock = threading.Lock()
        self._f = None
        self._size = 0
        self._buf: list[str] = []
        self._last_flush = time.monotonic()
        self.dropped_segments = 0
        self.records = 0
        self.bytes_written = 0
        self.records_dropped = 0          # records a failed write lost (a full disk): counted, never raised
        self.write_errors = 0
        self.disk_full = False            # the last write failed; the next flush tries again
        existing = _segments(self.root)           # a directory left by an earlier process: go on after it
        self._next = 1 + max((int(p.stem[len(SEGMENT_PREFIX):]) for p in existing
                              if p.stem[len(SEGMENT_PREFIX):].isdigit()), default=0)
        self._sizes = {p: p.stat().st_size for p in existing}

    # ---- writing -------------------------------------------------------------------------
    def write(self, record: dict) -> None:
        self._append(json.dumps(record, separators=(",", ":"), default=_plain) + "\n")

    def write_plain(self, record: dict) -> None:
        """write() for the per-step records made of str, int, bool, None and lists / dicts of them (no
        floats: msgspec writes NaN as null where json writes NaN): encoded by msgspec where installed,
        the same JSON but for non-ASCII text left unescaped (UTF-8, as the segment is); anything else
        in it falls back to write()."""
        if _PLAIN_ENCODER is None:
            return self.write(record)
        try:
            line = _PLAIN_ENCODER.encode(record).decode() + "\n"
        except (TypeError, OverflowError):          # a type msgspec does not encode plainly, a huge int
            return self.write(record)
        self._append(line)

    def _append(self, line: str) -> None:
        with self._lock:
            self._buf.append(line)
            self.records += 1
            if time.monotonic() - self._last_flush >= self.flush_s:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        self._last_flush = time.monotonic()
        if not self._buf:
            return
        data = "".join(self._buf)
        lost = len(self._buf)
        self._buf.clear()
        try:
            if self._f is None or self._size >= self.segment_bytes:
                self._open_segment()
            self._f.write(data)
            self._f.flush()
        except OSError as e:
            # a full disk (or a removed directory): one log line per episode, a counter of what was lost,
            # and the segment closed (a torn line is never appended to); the next flush tries again
            self.records_dropped += lost
            self.write_errors += 1
            if not self.disk_full:
                log.warning("flight recorder: cannot write %s (%s): records are dropped and counted until it can",
                            self.root, errno.errorcode.get(e.errno, e.errno) if e.errno else e)
            self.disk_full = True
            self._close_quietly()
            return
        if self.disk_full:
            log.warning("flight recorder: writing %s again (%d records were dropped)", self.root, self.records_dropped)
            self.disk_full = False
        n = len(data.encode())
        self._size += n
        self.bytes_written += n
        self._sizes[self._path] = self._size
        self._trim()

    def _close_quietly(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
        self._size = self.segment_bytes          # the next flush opens a fresh segment

    def _open_segment(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self.root.mkdir(parents=True, exist_ok=True)
        self._path = self.root / f"{SEGMENT_PREFIX}{self._next:06d}.jsonl"
        self._next += 1
        self._f = open(self._path, "w", encoding="utf-8")
        head = json.dumps({"k": "header", **self.header, "segment": self._path.name, "opened": time.time()},
                          separators=(",", ":"), default=_plain) + "\n"
        self._f.write(head)
        self._size = len(head.encode())

    def _trim(self) -> None:
        """Oldest segments out until the ring fits (never the one being written)."""
        total = sum(self._sizes.values())
        for p in sorted(self._sizes):
            if total <= self.max_bytes or p == self._path:
                break
            total -= self._sizes.pop(p)
            try:
                os.unlink(p)
            except OSError:
                pass
            self.dropped_segments += 1

    def close(self) -> None:
        with self._lock:
            self._flush_locked()
            if self._f is not None:
                self._f.close()
                self._f = None

    @property
    def total_bytes(self) -> int:
        return sum(self._sizes.values())


def prompt_fields(ids, block_size: int, privacy: bool) -> dict:
    """A request record's prompt: its token ids, or (privacy) its length and per-block digests, the
    prefix-provenance chain, which a replay reads as Mooncake-style hash ids (the sharing is kept)."""
    ids = list(ids)
    if not privacy:
        return {"prompt_token_ids": ids}
    from probes.provenance import chain
    return {"prompt_len": len(ids), "hash_ids": chain(ids, block_size, len(ids) // block_size),
            "hash_block_size": block_size}


def _plain(x):
    """JSON for what json does not know: numpy scalars and arrays, tuples, sets, dataclasses."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    if hasattr(x, "__dataclass_fields__"):
        import dataclasses
        return dataclasses.asdict(x)
    return str(x)
