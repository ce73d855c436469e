"""A repro bundle: the ring's segments at one moment, copied aside with a manifest.

Frozen on a finding >= error, an exception in a step, SIGTERM / SIGUSR1 (the vLLM plugin), or
on demand (`kvwb dump DIR`, `recorder.freeze()`): the ring keeps moving, the bundle does not.
A bundle is a directory that opens like a recorder directory (open_recording, read_trace,
Workbench.open, `kvwb replay`). Bundles live in the recording's `bundles/` and are not counted
in the ring's size cap: they are kept until someone deletes them.
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
from pathlib import Path

from .ring import SEGMENT_PREFIX

BUNDLES = "bundles"


def freeze(ring, reason: str) -> Path:
    """Freeze a live ring (its lock held: no segment rotates or goes while it is copied)."""
    ring.flush()
    with ring._lock:
        return freeze_dir(ring.root, reason, header=ring.header, lock=False)


def freeze_dir(root, reason: str, header: dict | None = None, lock: bool = False) -> Path:
    """Freeze a recorder directory, its writer alive or not (kvwb dump)."""
    root = Path(root)
    segs = sorted(root.glob(f"{SEGMENT_PREFIX}*.jsonl"))
    if not segs:
        raise FileNotFoundError(f"{root}: not a recording (no {SEGMENT_PREFIX}*.jsonl segments)")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", reason)[:60] or "dump"
    out = root / BUNDLES / f"{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9:09d}-{safe}"
    # Copied into a hidden directory and renamed once whole: whoever watches bundles/ (an operator,
    # a test, a tool polling for the SIGUSR1 dump) never opens a bundle whose segments are half there.
    part = out.with_name(f".partial-{out.name}.tmp")
    part.mkdir(parents=True)
    copied = []
    for p in segs:
        with contextlib.suppress(FileNotFoundError):     # the ring dropped it meanwhile (a live writer)
            shutil.copy2(p, part / p.name)
            copied.append(p.name)
    (part / "manifest.json").write_text(json.dumps({"reason": reason, "frozen": time.time(), "segments": copied,
                                                    "header": header}, indent=1, default=str))
    part.rename(out)
    return out
