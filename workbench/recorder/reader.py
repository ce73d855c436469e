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


# StepFinished columns compared between a recording and its replay
STEP_COLUMNS = ("num_tokens", "num_running", "num_waiting", "num_preemptions", "pages_used")


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
    blocks: list[dict] = field(default_factory=list)                  # vLLM: block ids per KV group as sent
    tokens: list[dict] = field(default_factory=list)                  # produced token ids, by step
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
        from ..event_log import EventLog
        log = EventLog(max_rows=None)
        self.names: dict[int, str] = {}          # vLLM's request ids are strings: numbered for the pool views
        index: dict = {}
        for name, fields in self.events:
            t = EVENT_BY_NAME[name]
            kw = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
            rid = kw.get("request_id")
            if rid is not None and not isinstance(rid, int):
                if rid not in index:
                    index[rid] = len(index)
                    self.names[index[rid]] = rid
                kw["request_id"] = index[rid]
            log.record(t(**kw))
        return log

    def time_travel(self):
        from ..trace.timetravel import TimeTravel
        return TimeTravel(self.event_log(), self.num_blocks)

    def settings(self) -> dict:
        """The EngineConfig fields the recording ran with (those it says): block size, pool size,
        batching limits, prefix caching."""
        h = self.header
        kw = {"page_size": h.get("block_size"), "num_pages": h.get("num_blocks") or None,
              **{k: h.get(k) for k in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching")}}
        return {k: v for k, v in kw.items() if v is not None}

    def engine_config(self, **overrides):
        """An EngineConfig with what the recording ran with (overrides win)."""
        from ..engine import EngineConfig
        return EngineConfig(**{**self.settings(), **overrides})

    def replay(self, target=None, mode: str = "simulate", **kw):
        """The recorded requests through our engine (`full`, target: an Engine or Workbench built with
        engine_config()) or the simulator (`simulate`, the default), with the recorded settings, on the
        trace replayer's virtual clock (arrival times)."""
        from ..trace.replaying import replay
        return replay(self.trace(), target if target is not None else self.engine_config(), mode,
                      progress=kw.pop("progress", False), **kw)

    def replay_steps(self, engine, max_steps: int | None = None):
        """The recorded requests through `engine` (an Engine or a Workbench on one) step-synchronously:
        each is added before the step it arrived at in the recording, with its own prompt and sampling,
        so a correct engine with the recorded settings repeats the recorded schedule step for step
        (compare() names the first step where it does not). Returns the replay's EventLog."""
        from ..engine.sequence import SamplingParams
        from ..event_log import EventLog
        eng = getattr(engine, "engine", engine)
        log = EventLog(eng.bus, max_rows=None)
        todo = sorted(self.requests, key=lambda r: (r.get("step", 0), r.get("arrival_s", 0.0)))
        if any(r.get("prompt_token_ids") is None for r in todo):
            raise RecordingError(f"{self.path}: recorded with privacy on (no token ids): replay it with "
                                 f"replay(mode='simulate'), which keeps the prefix sharing")
        fields = set(SamplingParams.__dataclass_fields__)
        i, limit = 0, max_steps or 10 * (len(self.events) + len(todo) + 10)
        while (i < len(todo) or eng.has_unfinished()) and eng.step_count < limit:
            while i < len(todo) and todo[i].get("step", 0) <= eng.step_count:
                r = todo[i]
                sp = {k: v for k, v in (r.get("sampling") or {}).items() if k in fields}
                sp["max_tokens"] = r.get("output_len") or 16
                if "stop_token_ids" in sp:
                    sp["stop_token_ids"] = tuple(sp["stop_token_ids"])
                eng.add_request(r["prompt_token_ids"], SamplingParams(**sp), request_id=r.get("id"))
                i += 1
            eng.step()
        log.detach()
        return log

    def compare(self, result, engine=None) -> dict | None:
        """Recorded vs replayed, step by step: the first step where the schedules (tokens, running,
        waiting, preemptions) or the pools (pages in use) part, or None when they never do. With the
        replaying `engine` (or the simulator), it also says whether the settings differ (a config
        difference explains the parting) or not (then look for a bug)."""
        out = self._first_parting(result)
        if out is not None and engine is not None:
            cfg = getattr(getattr(engine, "engine", engine), "config", None)
            diff = {k: (v, getattr(cfg, k)) for k, v in self.settings().items()
                    if getattr(cfg, k, None) is not None and getattr(cfg, k) != v}
            out["config_differs"] = diff
            out["said"] += ("; the settings differ (" + ", ".join(f"{k} recorded {a} vs replayed {b}"
                                                                  for k, (a, b) in diff.items())
                            + "): a config difference" if diff else
                            "; the settings are the same: a difference in the engine (a bug, or a change)")
        return out

    @staticmethod
    def _replayed_steps(result) -> list[dict]:
        if hasattr(result, "frame") and not hasattr(result, "steps"):          # an EventLog (replay_steps)
            df = result.frame("StepFinished")
            return df.to_dict("records") if len(df) else []
        return result.steps.to_dict("records") if hasattr(result.steps, "to_dict") else list(result.steps)

    def _first_parting(self, result) -> dict | None:
        rec = [f for n, f in self.events if n == "StepFinished"]
        rep = self._replayed_steps(result)
        for a, b in zip(rec, rep):
            diff = {k: (a[k], b[k]) for k in STEP_COLUMNS
                    if a.get(k) is not None and b.get(k) is not None and int(a[k]) != int(b[k])}
            if diff:
                return {"step": int(a["step"]), "differs": diff,
                        "said": f"step {a['step']}: " + ", ".join(f"{k} recorded {x} vs replayed {y}"
                                                                  for k, (x, y) in diff.items())}
        if len(rec) != len(rep):
            n = min(len(rec), len(rep))
            return {"step": n + 1, "differs": {"steps": (len(rec), len(rep))},
                    "said": f"after step {n}: {len(rec)} steps recorded, {len(rep)} replayed"}
        return None

    def blocks_of(self, request, step: int | None = None) -> list[list[int]]:
        """A request's block ids per KV cache group at `step` (default: the last recorded), rebuilt from
        what crossed to the workers: whole lists when it was scheduled new or resumed, appends after."""
        out: list[list[int]] = []
        for r in self.blocks:
            if r.get("request_id") != request or (step is not None and r.get("step", 0) > step):
                continue
            groups = r.get("groups") or []
            if r.get("replace"):
                out = [list(g) for g in groups]
            else:
                while len(out) < len(groups):
                    out.append([])
                for g, ids in enumerate(groups):
                    out[g].extend(ids)
        return out

    def side_by_side(self, result):
        """Recorded and replayed steps in one DataFrame (tokens, running, waiting, preemptions, blocks in
        use), with a `parts` column marking the steps where they differ."""
        import pandas as pd
        cols = list(STEP_COLUMNS)
        rec = pd.DataFrame([f for n, f in self.events if n == "StepFinished"]).reindex(columns=["step", *cols])
        rep = self._replayed_steps(result)
        rep = pd.DataFrame(rep).reindex(columns=["step", *cols]) if rep else pd.DataFrame(columns=["step", *cols])
        df = rec.merge(rep, on="step", how="outer", suffixes=("_recorded", "_replayed")).sort_values("step")
        df["parts"] = False
        for c in cols:
            df["parts"] |= df[f"{c}_recorded"].ne(df[f"{c}_replayed"])
        return df.reset_index(drop=True)

    def findings_frame(self):
        """The recorded findings in the workbench's findings columns."""
        import pandas as pd
        from ..findings import COLUMNS
        return pd.DataFrame(self.findings).reindex(columns=COLUMNS)

    def dashboard(self, **kw):
        """The page map, timelines and findings over the recorded pool, scrubbable (not live)."""
        from ..widgets.dashboard import Dashboard
        kw.setdefault("title", f"recording: {self.path.name} ({self.header.get('writer', '?')})")
        return Dashboard(self.event_log(), self.num_blocks, findings=self.findings_frame(), live=False, **kw)

    def outputs(self) -> dict:
        """Request id (as its request record has it) -> {"tokens": what it produced, in order (None
        where the recording kept only counts: privacy), "finished": bool}. Only requests whose request
        record is in the recording (the ring may have dropped the oldest)."""
        ids = {str(r.get("id")): r.get("id") for r in self.requests}
        got: dict = {}
        for t in self.tokens:
            for rid, new in (t.get("out") or {}).items():
                if rid not in ids:
                    continue
                o = got.setdefault(ids[rid], {"tokens": [], "finished": False})
                if isinstance(new, list) and o["tokens"] is not None:
                    o["tokens"].extend(int(x) for x in new)
                else:
                    o["tokens"] = None
            for rid in t.get("finished") or ():
                if rid in ids:
                    got.setdefault(ids[rid], {"tokens": [], "finished": False})["finished"] = True
        return got

    def frame(self, what: str = "requests"):
        import pandas as pd
        if what == "requests":
            return pd.DataFrame(self.requests)
        if what == "findings":
            return pd.DataFrame(self.findings)
        if what == "blocks":
            return pd.DataFrame(self.blocks)
        if what == "steps":
            return pd.DataFrame(self.steps or [f for n, f in self.events if n == "StepFinished"])
        raise ValueError(f"frame({what!r}): one of 'requests', 'findings', 'steps', 'blocks'")


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
            elif kind == "blocks":
                rec.blocks.append(obj)
            elif kind == "tokens":
                rec.tokens.append(obj)
            else:
                bad(f"{seg}:{i}: unknown record kind {kind!r}", "unknown_records")
        if header is None and seg.name not in rec.segments and not any(str(seg) in p for p in rec.problems):
            bad(f"{seg}: empty segment", "segments_without_header")
    if not rec.segments:
        raise RecordingError(f"{root}: no segment could be read: {'; '.join(rec.problems[:3])}")
    return rec


def load_trace(path, format: str = "auto"):
    """A request trace from a trace file (trace/readers.py read_trace) or a flight recording (a recorder
    directory or a frozen bundle: its requests), whichever `path` is; a bad recording is a
    TraceFormatError naming it, as a bad trace file is."""
    from ..trace.readers import TraceFormatError, read_trace
    root = Path(path)
    if format in ("auto", "recording") and root.is_dir():
        try:
            return open_recording(root).trace()
        except RecordingError as e:
            raise TraceFormatError(root, None, str(e)) from None
    return read_trace(path, format="auto" if format == "recording" else format)
