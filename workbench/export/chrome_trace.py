"""Chrome trace / Perfetto JSON from an EventLog.

Steps are complete ("X") slices, pool usage and bandwidth are counters ("C"), each
request is an async slice ("b"/"e") from arrival to finish, and process / thread names
are metadata ("M"). Timestamps are the events' own clock in microseconds (perf_counter,
CLOCK_MONOTONIC on Linux; the virtual clock for a simulated replay), so a trace taken
in the same process as a torch.profiler run can be merged with merge_into().
"""
from __future__ import annotations

import json
from pathlib import Path

from ..events import RequestArrived, RequestFinished, StepFinished

PID = "kvwb"
TID_STEPS, TID_REQUESTS = 1, 2


def to_chrome_trace(log) -> dict:
    ev = [
        {"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "args": {"name": "PagedKV Workbench engine"}},
        {"ph": "M", "name": "thread_name", "pid": PID, "tid": TID_STEPS, "args": {"name": "engine steps"}},
        {"ph": "M", "name": "thread_name", "pid": PID, "tid": TID_REQUESTS, "args": {"name": "requests"}},
    ]
    steps = log.frame(StepFinished)
    for r in steps.itertuples(index=False):
        end_us = r.t_ns / 1e3
        dur_us = r.duration_ns / 1e3
        ev.append({"ph": "X", "name": f"step {r.step}", "cat": "step", "pid": PID, "tid": TID_STEPS,
                   "ts": end_us - dur_us, "dur": dur_us,
                   "args": {"tokens": int(r.num_tokens), "seqs": int(r.num_seqs),
                            "prefill_tokens": int(r.num_prefill_tokens), "decode_tokens": int(r.num_decode_tokens)}})
        ev.append({"ph": "C", "name": "kv pages", "pid": PID, "tid": TID_STEPS, "ts": end_us,
                   "args": {"used": int(r.pages_used), "cached": int(r.pages_cached)}})
        moved = r.bytes_weights + r.bytes_kv_read + r.bytes_kv_written
        if r.duration_ns > 0 and moved > 0:
            ev.append({"ph": "C", "name": "bandwidth GB/s", "pid": PID, "tid": TID_STEPS, "ts": end_us,
                       "args": {"achieved": moved / r.duration_ns}})
        ev.append({"ph": "C", "name": "requests", "pid": PID, "tid": TID_STEPS, "ts": end_us,
                   "args": {"running": int(r.num_running), "waiting": int(r.num_waiting)}})
    for r in log.frame(RequestArrived).itertuples(index=False):
        ev.append({"ph": "b", "name": f"request {r.request_id}", "cat": "request", "id": int(r.request_id),
                   "pid": PID, "tid": TID_REQUESTS, "ts": r.t_ns / 1e3,
                   "args": {"prompt_len": int(r.prompt_len), "max_tokens": int(r.max_tokens)}})
    for r in log.frame(RequestFinished).itertuples(index=False):
        ev.append({"ph": "e", "name": f"request {r.request_id}", "cat": "request", "id": int(r.request_id),
                   "pid": PID, "tid": TID_REQUESTS, "ts": r.t_ns / 1e3,
                   "args": {"reason": r.reason, "output_len": int(r.output_len),
                            "preemptions": int(r.num_preemptions)}})
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


def write_chrome_trace(log, path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(log)))
    return path


def merge_into(ours: dict, profiler_trace_path) -> dict:
    """Our events added to a torch.profiler (Kineto) Chrome trace, as another process."""
    with open(profiler_trace_path) as f:
        theirs = json.load(f)
    events = theirs.get("traceEvents", theirs if isinstance(theirs, list) else [])
    merged = dict(theirs) if isinstance(theirs, dict) else {}
    merged["traceEvents"] = list(events) + ours["traceEvents"]
    return merged
