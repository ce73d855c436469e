"""The flight recorder: what the engine and its page pool did, kept on disk, bounded, crash-safe.

  ring.py      SegmentRing: JSONL segments with self-describing headers, a size cap, oldest out
  engine.py    EngineRecorder: our engine's events into a ring (EngineConfig.record_dir)
  reader.py    open_recording(): a recorder directory or a frozen bundle, as requests (a Trace),
               an EventLog and TimeTravel; torn or corrupt segments named, the rest opened
  bundle.py    freeze(): the ring's window copied into a repro bundle (on a finding, a signal,
               `kvwb dump`)
"""
from .ring import SCHEMA, SegmentRing

__all__ = ["SCHEMA", "SegmentRing"]
