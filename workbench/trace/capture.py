"""Capture: every request that reaches the engine, appended to a JSONL trace as it arrives.

A subscriber like any other: TraceCapture(engine, path) listens to RequestSubmitted, which
add_request emits on the caller's thread before it returns. One line per record, written
and flushed then, so a process killed at any moment leaves every accepted request on disk
(a torn last line is skipped by the reader). The format is the native one read_trace reads.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict
from pathlib import Path

from ..events import RequestSubmitted


class TraceCapture:
    def __init__(self, engine, path: str | Path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")
        self._lock = threading.Lock()          # add_request may run on many threads
        self._t0 = time.perf_counter()
        self._last = 0.0
        self.count = 0
        self.bus = engine.bus
        self.bus.subscribe(RequestSubmitted, self._on_submitted)

    def _on_submitted(self, e: RequestSubmitted) -> None:
        rid = e.request_id if e.user_request_id is None else e.user_request_id
        self.record(rid, e.prompt_token_ids, e.params, e.arrival_time)

    def record(self, request_id, prompt_token_ids: list[int], params, arrival: float | None = None) -> None:
        t = max((arrival if arrival is not None else time.perf_counter()) - self._t0, 0.0)
        sampling = {k: v for k, v in asdict(params).items() if k != "max_tokens"}
        sampling["stop_token_ids"] = list(sampling.get("stop_token_ids", ()))
        with self._lock:
            if self._f.closed:
                return
            # threads race between stamping and writing: keep the file in arrival order
            t = self._last = max(t, self._last)
            line = json.dumps({"id": request_id, "arrival_s": round(t, 6), "output_len": params.max_tokens,
                               "prompt_token_ids": list(prompt_token_ids), "sampling": sampling},
                              separators=(",", ":"))
            self._f.write(line + "\n")
            self._f.flush()
            self.count += 1

    def close(self) -> None:
        """Stop listening and close the file."""
        if self.bus is not None:
            self.bus.unsubscribe(self._on_submitted)
            self.bus = None
        with self._lock:
            if not self._f.closed:
                self._f.close()
