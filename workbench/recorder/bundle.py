"""A repro bundle: the ring's segments at one moment, copied aside with a manifest.

Frozen on a finding >= error, an exception in a step, SIGTERM / SIGUSR1, or on demand
(`kvwb dump`, `Recorder.freeze()`). The ring keeps moving; the bundle does not. A bundle is a
directory that opens like a recorder directory (open_recording, read_trace, Workbench.open).
"""
from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

BUNDLES = "bundles"


def freeze(ring, reason: str) -> Path:
    ring.flush()
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", reason)[:60] or "dump"
    out = ring.root / BUNDLES / f"{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9:09d}-{safe}"
    out.mkdir(parents=True)
    with ring._lock:                       # a consistent set: no segment rotates or goes meanwhile
        names = [p for p in sorted(ring._sizes) if p.exists()]
        for p in names:
            shutil.copy2(p, out / p.name)
    (out / "manifest.json").write_text(json.dumps(
        {"reason": reason, "frozen": time.time(), "segments": [p.name for p in names], "header": ring.header},
        indent=1, default=str))
    return out
