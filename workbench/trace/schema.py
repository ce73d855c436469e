"""Trace records: one request a record, as production saw it.

A prompt is given one of three ways: token ids, text, or a length plus prefix-block
hash ids (Mooncake-style: equal hash ids mean equal token blocks, so prefix caching
sees exactly the sharing production saw).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterator


class TraceFormatError(ValueError):
    """A trace that cannot be read; the message names file:line and what is wrong."""

    def __init__(self, path, line: int | None, message: str):
        self.path, self.line = str(path), line
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")


@dataclass
class TraceRecord:
    id: Any
    arrival_s: float
    output_len: int
    prompt_len: int
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    hash_ids: list[int] | None = None
    hash_block_size: int | None = None
    sampling: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        return {k: v for k, v in d.items() if v is not None and v != {}}


@dataclass
class Trace:
    records: list[TraceRecord]
    source: str = ""
    format: str = ""
    skipped: dict = field(default_factory=dict)     # reason -> count (failed rows, torn last line)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[TraceRecord]:
        return iter(self.records)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Trace(self.records[i], self.source, self.format, dict(self.skipped))
        return self.records[i]

    def frame(self):
        import pandas as pd
        return pd.DataFrame([{"id": r.id, "arrival_s": r.arrival_s, "prompt_len": r.prompt_len,
                              "output_len": r.output_len,
                              "num_hash_blocks": len(r.hash_ids) if r.hash_ids else 0}
                             for r in self.records])

    def repeated_block_fraction(self) -> float:
        """Share of prefix blocks that an earlier request already carried (what a prefix cache can hit)."""
        seen, total, repeated = set(), 0, 0
        for r in self.records:
            for h in r.hash_ids or ():
                total += 1
                if h in seen:
                    repeated += 1
                else:
                    seen.add(h)
        return repeated / total if total else 0.0
