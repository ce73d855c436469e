"""Trace readers: native JSONL / Parquet, and importers for Mooncake, Azure and BurstGPT.

Every reader names file:line for a malformed row. A torn last line (a capture killed
mid-write) is skipped and counted, never an error. Rows a format defines as failed
(BurstGPT with 0 response tokens) are skipped and counted too.
"""
from __future__ import annotations

import csv
import json
import math
from datetime import datetime
from pathlib import Path

from .schema import Trace, TraceFormatError, TraceRecord

FORMATS = ("jsonl", "parquet", "mooncake", "azure", "burstgpt")


def _nonneg_int(path, line, row: dict, key: str, label: str | None = None) -> int:
    if key not in row or row[key] is None or row[key] == "":
        raise TraceFormatError(path, line, f"missing field {label or key!r}")
    v = row[key]
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise TraceFormatError(path, line, f"field {label or key!r} is {v!r}, not a number") from None
    if not math.isfinite(f) or f != int(f):
        raise TraceFormatError(path, line, f"field {label or key!r} is {v!r}, not a whole number")
    if f < 0:
        raise TraceFormatError(path, line, f"field {label or key!r} is negative ({v})")
    return int(f)


def _check_sorted(path, records: list[TraceRecord], lines: list[int]) -> None:
    for i in range(1, len(records)):
        if records[i].arrival_s < records[i - 1].arrival_s:
            raise TraceFormatError(path, lines[i], f"timestamps go back in time ({records[i].arrival_s} s "
                                   f"after {records[i - 1].arrival_s} s on the line before); sort the trace by arrival")


def _json_lines(path: Path):
    """(line number, parsed dict) for each line; a torn last line is reported as None."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.strip():
        raise TraceFormatError(path, None, "the file is empty")
    lines = data.split(b"\n")
    torn_possible = not data.endswith(b"\n")
    for i, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if torn_possible and i == len(lines):
                yield i, None                     # the last line was cut mid-write
                return
            raise TraceFormatError(path, i, f"not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(path, i, f"expected a JSON object, got {type(obj).__name__}")
        yield i, obj


def read_jsonl(path) -> Trace:
    """Native format: {"id", "arrival_s", "output_len", and prompt_token_ids | prompt_text |
    prompt_len (+ hash_ids, hash_block_size), optional "sampling"}."""
    path = Path(path)
    recs, lines, skipped = [], [], {}
    for i, o in _json_lines(path):
        if o is None:
            skipped["torn_last_line"] = 1
            continue
        if "arrival_s" not in o:
            raise TraceFormatError(path, i, "missing field 'arrival_s'")
        try:
            arrival = float(o["arrival_s"])
        except (TypeError, ValueError):
            raise TraceFormatError(path, i, f"field 'arrival_s' is {o['arrival_s']!r}, not a number") from None
        if arrival < 0 or not math.isfinite(arrival):
            raise TraceFormatError(path, i, f"field 'arrival_s' is {arrival}: must be a finite time >= 0")
        out = _nonneg_int(path, i, o, "output_len")
        ids, text, hashes = o.get("prompt_token_ids"), o.get("prompt_text"), o.get("hash_ids")
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise TraceFormatError(path, i, "field 'prompt_token_ids' must be a list of non-negative ints")
            plen = len(ids)
        elif text is not None:
            if not isinstance(text, str):
                raise TraceFormatError(path, i, "field 'prompt_text' must be a string")
            plen = _nonneg_int(path, i, o, "prompt_len") if "prompt_len" in o else len(text)
        else:
            plen = _nonneg_int(path, i, o, "prompt_len", "prompt_len (or prompt_token_ids / prompt_text)")
        if hashes is not None and (not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes)):
            raise TraceFormatError(path, i, "field 'hash_ids' must be a list of ints")
        block = o.get("hash_block_size")
        if hashes is not None and not (isinstance(block, int) and block > 0):
            raise TraceFormatError(path, i, "field 'hash_block_size' (a positive int) is required with 'hash_ids'")
        sampling = o.get("sampling") or {}
        if not isinstance(sampling, dict):
            raise TraceFormatError(path, i, "field 'sampling' must be an object")
        recs.append(TraceRecord(o.get("id", len(recs)), arrival, out, plen, ids, text, hashes, block, sampling))
        lines.append(i)
    _check_sorted(path, recs, lines)
    return Trace(recs, str(path), "jsonl", skipped)


def read_mooncake(path) -> Trace:
    """Mooncake FAST'25: {"timestamp" ms, "input_length", "output_length", "hash_ids" over 512-token blocks}."""
    path = Path(path)
    recs, lines, skipped = [], [], {}
    for i, o in _json_lines(path):
        if o is None:
            skipped["torn_last_line"] = 1
            continue
        ts = _nonneg_int(path, i, o, "timestamp")
        plen = _nonneg_int(path, i, o, "input_length")
        out = _nonneg_int(path, i, o, "output_length")
        hashes = o.get("hash_ids")
        if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
            raise TraceFormatError(path, i, "field 'hash_ids' must be a list of ints")
        if len(hashes) != -(-plen // 512):
            raise TraceFormatError(path, i, f"{len(hashes)} hash_ids for input_length {plen}: "
                                   f"expected ceil({plen}/512) = {-(-plen // 512)}")
        recs.append(TraceRecord(len(recs), ts / 1000.0, out, plen, hash_ids=hashes, hash_block_size=512))
        lines.append(i)
    _check_sorted(path, recs, lines)
    return Trace(recs, str(path), "mooncake", skipped)


def _csv_rows(path: Path, required: list[str]):
    with open(path, newline="", encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise TraceFormatError(path, None, "the file is empty")
    reader = csv.DictReader(text.splitlines())
    header = reader.fieldnames or []
    missing = [c for c in required if c not in header]
    if missing:
        raise TraceFormatError(path, 1, f"header {header} lacks column(s) {missing}")
    torn = not text.endswith("\n")
    rows = list(reader)
    for n, row in enumerate(rows):
        line = reader.line_num if False else n + 2
        last = n == len(rows) - 1
        if None in row or any(row.get(c) in (None, "") for c in required):
            if torn and last:
                yield line, None
                return
            bad = [c for c in required if row.get(c) in (None, "")]
            raise TraceFormatError(path, line, f"missing value for {bad or 'a column'}" if bad
                                   else "more values than header columns")
        yield line, row


def _parse_time(path, line, v: str) -> float:
    try:
        return float(v)
    except ValueError:
        pass
    try:  # Azure: 'YYYY-MM-DD HH:MM:SS.fffffff' (7 fractional digits: trim to microseconds)
        head, _, frac = v.partition(".")
        return datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp() + (float("0." + frac) if frac else 0.0)
    except ValueError:
        raise TraceFormatError(path, line, f"timestamp {v!r} is neither seconds nor 'YYYY-MM-DD HH:MM:SS.f'") from None


def read_azure(path) -> Trace:
    """Azure LLM inference trace CSV: TIMESTAMP, ContextTokens, GeneratedTokens."""
    path = Path(path)
    recs, lines, skipped, t0 = [], [], {}, None
    for line, row in _csv_rows(path, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]):
        if row is None:
            skipped["torn_last_line"] = 1
            continue
        t = _parse_time(path, line, row["TIMESTAMP"])
        t0 = t if t0 is None else t0
        plen = _nonneg_int(path, line, row, "ContextTokens")
        out = _nonneg_int(path, line, row, "GeneratedTokens")
        recs.append(TraceRecord(len(recs), t - t0, out, plen))
        lines.append(line)
    _check_sorted(path, recs, lines)
    return Trace(recs, str(path), "azure", skipped)


def read_burstgpt(path) -> Trace:
    """BurstGPT CSV: Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type
    (+ Session ID, Elapsed time in newer releases). 0 response tokens = a failed request: skipped."""
    path = Path(path)
    recs, lines, skipped = [], [], {}
    for line, row in _csv_rows(path, ["Timestamp", "Request tokens", "Response tokens"]):
        if row is None:
            skipped["torn_last_line"] = 1
            continue
        t = _parse_time(path, line, row["Timestamp"])
        plen = _nonneg_int(path, line, row, "Request tokens")
        out = _nonneg_int(path, line, row, "Response tokens")
        if out == 0:
            skipped["failed_requests"] = skipped.get("failed_requests", 0) + 1
            continue
        sampling = {k: row[k] for k in ("Model", "Log Type", "Session ID") if row.get(k)}
        recs.append(TraceRecord(len(recs), t, out, plen, sampling={"meta": sampling} if sampling else {}))
        lines.append(line)
    if recs:
        t0 = recs[0].arrival_s
        for r in recs:
            r.arrival_s -= t0
    _check_sorted(path, recs, lines)
    return Trace(recs, str(path), "burstgpt", skipped)


def read_parquet(path) -> Trace:
    import pandas as pd
    path = Path(path)
    try:
        df = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several types for a non-Parquet file
        raise TraceFormatError(path, None, f"not a readable Parquet file ({type(e).__name__}: {e})") from None
    for c in ("arrival_s", "output_len"):
        if c not in df.columns:
            raise TraceFormatError(path, None, f"missing column {c!r}")
    recs = []
    for i, row in enumerate(df.to_dict("records")):
        line = i + 1              # row number, for messages
        clean = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in row.items()
                 if not (isinstance(v, float) and math.isnan(v)) and v is not None}
        ids = clean.get("prompt_token_ids")
        plen = len(ids) if ids is not None else _nonneg_int(path, line, clean, "prompt_len")
        out = _nonneg_int(path, line, clean, "output_len")
        sampling = clean.get("sampling")
        sampling = json.loads(sampling) if isinstance(sampling, str) else (sampling or {})
        recs.append(TraceRecord(clean.get("id", i), float(clean["arrival_s"]), out, plen, ids,
                                clean.get("prompt_text"), clean.get("hash_ids"),
                                clean.get("hash_block_size"), sampling))
    _check_sorted(path, recs, list(range(1, len(recs) + 1)))
    return Trace(recs, str(path), "parquet", {})


READERS = {"jsonl": read_jsonl, "parquet": read_parquet, "mooncake": read_mooncake,
           "azure": read_azure, "burstgpt": read_burstgpt}


def detect_format(path) -> str:
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        return "parquet"
    if not head.strip():
        raise TraceFormatError(path, None, "the file is empty")
    first = head.split(b"\n", 1)[0].decode("utf-8", "replace").strip()
    if first.startswith("{"):
        return "mooncake" if '"input_length"' in first and '"hash_ids"' in first else "jsonl"
    if "TIMESTAMP" in first and "ContextTokens" in first:
        return "azure"
    if "Request tokens" in first and "Response tokens" in first:
        return "burstgpt"
    raise TraceFormatError(path, 1, f"unrecognised trace format (first line {first[:80]!r}); "
                           f"expected one of {', '.join(FORMATS)}")


def read_trace(path, format: str = "auto") -> Trace:
    """Read a request trace; format "auto" looks at the file's first bytes."""
    path = Path(path)
    if path.is_dir():
        # a flight recording is read a layer above this one (workbench/recorder: it builds on traces)
        raise TraceFormatError(path, None, "a directory, not a trace file: a flight recording is read with "
                                           "workbench.recorder.load_trace(path) (kvwb replay does), or "
                                           "Workbench.open(path).trace()")
    if not path.is_file():
        raise TraceFormatError(path, None, "no such file")
    fmt = detect_format(path) if format == "auto" else format
    if fmt not in READERS:
        raise TraceFormatError(path, None, f"unknown format {format!r}; use one of {', '.join(FORMATS)} or auto")
    return READERS[fmt](path)
