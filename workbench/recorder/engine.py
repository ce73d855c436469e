"""EngineRecorder: our engine's requests, page-pool events and steps, into a SegmentRing.

On when `EngineConfig.record_dir` is set (engine/consumers.py builds it; the engine imports
nothing of this package). A subscriber like any probe, to row events (EventBus.subscribe_rows:
no event object is built for it):

  request   per RequestSubmitted: id, arrival (seconds since the recording began), the prompt's
            token ids (with `privacy=True`, its length and per-page digests only: the same chain
            prefix provenance uses, so replay keeps the sharing production saw), sampling, max tokens
  ev        every pool and request-lifecycle event (allocated, freed, shared, evicted, registered,
            admitted, preempted, finished) and StepFinished, as its fields: enough for TimeTravel
            to rebuild the pool at any recorded step
  tokens    per finished request, what it produced (`out`: id -> token ids; with privacy, only
            their count): what a divergence triage compares against (diverge.RecordingSide)

The ring is flushed at each StepFinished and EngineIdle: a SIGKILL loses at most the step in
flight. Findings a probe reports go in too (`note_finding`), and freeze a bundle at >= error (one
per kind); so does an exception in Engine.step (StepFailed).
"""
from __future__ import annotations

import dataclasses
import os
import time

from ..events import (EVENT_BY_NAME, EngineIdle, PagesAllocated, PagesEvicted, PagesFreed, PagesRegistered,
                      PagesShared, RequestAdmitted, RequestFinished, RequestPreempted, RequestRejected,
                      RequestSubmitted, StepFailed, StepFinished)
from .ring import DEFAULT_MAX_BYTES, SegmentRing, prompt_fields

RECORDED = (PagesAllocated, PagesFreed, PagesShared, PagesEvicted, PagesRegistered, RequestAdmitted,
            RequestPreempted, RequestFinished, RequestRejected, StepFinished, StepFailed, EngineIdle)
_FIELDS = {t: [f.name for f in dataclasses.fields(t)] for t in RECORDED}


def engine_header(engine) -> dict:
    import torch
    cfg = dataclasses.asdict(engine.config)
    mc = getattr(engine, "model_config", None) or getattr(getattr(engine, "model", None), "config", None)
    model = dataclasses.asdict(mc) if dataclasses.is_dataclass(mc) else {"name": type(mc).__name__}
    return {"writer": "workbench engine", "engine_config": cfg, "model_config": model,
            "block_size": engine.pool.page_size, "num_blocks": engine.pool.num_pages,
            "max_num_seqs": engine.config.max_num_seqs,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "enable_prefix_caching": engine.config.enable_prefix_caching,
            "versions": {"torch": torch.__version__, "workbench": _version()}, "pid": os.getpid()}


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("pagedkv-workbench")
    except Exception:
        return "?"


class EngineRecorder:
    def __init__(self, engine, root, max_bytes: int = DEFAULT_MAX_BYTES, privacy: bool = False):
        self.engine = engine
        self.privacy = privacy
        self.ring = SegmentRing(root, engine_header(engine), max_bytes=max_bytes)
        self.keep_bundles = 16
        self.root = self.ring.root
        self._t0 = time.perf_counter()
        self.bundles: list[str] = []
        self._frozen_kinds: set[str] = set()
        self._ids: dict[int, object] = {}              # engine request id -> the id its request record has
        self.bus = engine.bus
        self.bus.subscribe(RequestSubmitted, self._submitted)
        self.bus.subscribe_rows(RECORDED, self._row)

    def _submitted(self, e: RequestSubmitted) -> None:
        rid = e.request_id if e.user_request_id is None else e.user_request_id
        self._ids[e.request_id] = rid
        params = dataclasses.asdict(e.params) if dataclasses.is_dataclass(e.params) else {}
        rec = {"k": "request", "id": rid, "rid": e.request_id, "step": e.step,
               "arrival_s": round(max(e.arrival_time - self._t0, 0), 6),
               "output_len": params.pop("max_tokens", None), "sampling": params}
        rec.update(prompt_fields(e.prompt_token_ids, self.engine.pool.page_size, self.privacy))
        self.ring.write(rec)

    def _row(self, etype: type, row: tuple) -> None:
        rec = {"k": "ev", "e": etype.__name__, **dict(zip(_FIELDS[etype], row))}
        if etype is RequestFinished:
            self._finished(rec)
            return
        self.ring.write(rec)
        if etype is StepFinished or etype is EngineIdle:
            self.ring.flush()
        elif etype is StepFailed:                 # an exception in the step: the window before it, frozen
            self.freeze("exception")

    def _finished(self, rec: dict) -> None:
        out = rec.pop("output_token_ids", ()) or ()
        self.ring.write(rec)
        rid = self._ids.pop(rec["request_id"], rec["request_id"])
        self.ring.write({"k": "tokens", "step": rec["step"], "finished": [str(rid)],
                         "out": {str(rid): len(out) if self.privacy else list(out)}})

    def note_finding(self, f) -> None:
        """A probe's finding, kept with the step it names; one >= error freezes a bundle."""
        self.ring.write({"k": "finding", "probe": f.probe, "severity": f.severity, "kind": f.kind,
                         "step": f.step, "request_id": f.request_id, "page": f.page, "message": f.message})
        if f.severity in ("error", "critical") and f.kind not in self._frozen_kinds:
            self._frozen_kinds.add(f.kind)            # one bundle per kind: a storm of one bug is one incident
            self.freeze(f"finding-{f.kind}")

    def freeze(self, reason: str = "on-demand") -> str:
        from .budget import trim_bundles
        from .bundle import freeze
        path = freeze(self.ring, reason)
        trim_bundles(self.root, self.keep_bundles)      # the oldest bundles beyond the budget go
        self.bundles.append(str(path))
        return str(path)

    def close(self) -> None:
        if self.bus is not None:
            self.bus.unsubscribe(self._submitted)
            self.bus.unsubscribe(self._row)
            self.bus = None
        self.ring.close()


assert set(_FIELDS) <= set(EVENT_BY_NAME.values())
