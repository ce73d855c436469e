"""Consumers an EngineConfig can ask for, named by module path: the engine imports none of them.

`EngineConfig(capture_trace="x.jsonl")` is a shortcut for `TraceCapture(engine, "x.jsonl")`
after construction: the capture subscribes to the engine's RequestSubmitted events like
any probe or view. Keeping the name here (resolved only when the field is set) lets the
engine package stay free of trace/, widgets/, export/ and probes/.
"""
from __future__ import annotations

import importlib

CAPTURE = "workbench.trace.capture:TraceCapture"
RECORDER = "workbench.recorder.engine:EngineRecorder"


def from_config(engine):
    """The trace capture the config asks for (None when it asks for none)."""
    path = engine.config.capture_trace
    if not path:
        return None
    mod, cls = CAPTURE.split(":")
    return getattr(importlib.import_module(mod), cls)(engine, path)


def recorder_from_config(engine):
    """The flight recorder the config asks for (EngineConfig.record_dir; None when unset)."""
    cfg = engine.config
    if not cfg.record_dir:
        return None
    mod, cls = RECORDER.split(":")
    return getattr(importlib.import_module(mod), cls)(engine, cfg.record_dir, max_bytes=cfg.record_max_bytes,
                                                      privacy=cfg.record_privacy)
