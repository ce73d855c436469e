"""The recorder's disk budget: earlier recordings and repro bundles kept within a count and a size.

Each engine core start (and each engine with record_dir) opens a recording directory of its own
under the record root, and every finding or signal may freeze a bundle (a copy of up to the
ring's window) inside it. Unbounded, a server restarted by its supervisor for a week, or a bug
that fires on every request, fills the disk. enforce() keeps, under the root, at most
`keep_runs` recording directories and `keep_bytes` bytes in all, and in each at most `keep_bundles`
bundles, removing the oldest first (by modification time); the recording being written (`current`)
and its live segments are never removed, only its oldest bundles. Anything it cannot remove (a
permission, a race with another process) is skipped and counted, never raised.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .bundle import BUNDLES
from .ring import SEGMENT_PREFIX


@dataclass
class Trimmed:
    runs: list[str] = field(default_factory=list)
    bundles: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    failed: int = 0


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    total = 0
    for f in p.rglob("*"):
        try:
            if f.is_file():
                total += f.stat().st_size
        except OSError:
            pass
    return total


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def _age(p: Path) -> tuple:
    """Oldest first: by mtime, ties (coarse file times, bundles frozen within one tick) by the name, which
    for a bundle begins with its time to the nanosecond (bundle.freeze_dir)."""
    return _mtime(p), p.name


def _bundles(bdir: Path) -> list[Path]:
    """The whole bundles in a run's bundles/ (not a hidden one still being written), oldest first."""
    return sorted((b for b in bdir.iterdir() if b.is_dir() and not b.name.startswith(".")), key=_age)


def _is_recording(p: Path) -> bool:
    return p.is_dir() and (any(p.glob(f"{SEGMENT_PREFIX}*.jsonl")) or (p / BUNDLES).is_dir())


def _remove(p: Path, out: Trimmed, into: list) -> int:
    n = _size(p)
    try:
        shutil.rmtree(p)
    except OSError:
        out.failed += 1
        return 0
    into.append(str(p))
    out.freed_bytes += n
    return n


def enforce(root, current=None, keep_runs: int = 8, keep_bytes: int = 2 * 2**30, keep_bundles: int = 16) -> Trimmed:
    """Trim `root` (the directory holding one recording directory per run) to the budget."""
    root, out = Path(root), Trimmed()
    current = Path(current).resolve() if current is not None else None
    if not root.is_dir():
        return out
    runs = sorted((p for p in root.iterdir() if _is_recording(p)), key=_mtime)
    # bundles first, in every run: the oldest beyond keep_bundles go
    for run in runs:
        bdir = run / BUNDLES
        if not bdir.is_dir():
            continue
        bundles = _bundles(bdir)
        for b in bundles[: max(0, len(bundles) - keep_bundles)]:
            _remove(b, out, out.bundles)
    # then whole earlier runs, oldest first, beyond keep_runs
    earlier = [r for r in runs if current is None or r.resolve() != current]
    keep_earlier = max(0, keep_runs - (1 if current is not None else 0))
    for run in earlier[: max(0, len(earlier) - keep_earlier)]:
        _remove(run, out, out.runs)
    # then bytes: earlier runs oldest first, then the current run's oldest bundles
    left = [r for r in earlier if str(r) not in out.runs]
    total = sum(_size(r) for r in left) + (_size(current) if current is not None and current.exists() else 0)
    for run in left:
        if total <= keep_bytes:
            break
        total -= _remove(run, out, out.runs)
    if total > keep_bytes and current is not None and (current / BUNDLES).is_dir():
        for b in _bundles(current / BUNDLES):
            if total <= keep_bytes:
                break
            total -= _remove(b, out, out.bundles)
    return out


def trim_bundles(run, keep_bundles: int = 16) -> Trimmed:
    """One recording's own bundles, the oldest beyond keep_bundles removed (our engine's recorder, whose
    record_dir is the user's: nothing around it is touched)."""
    out, bdir = Trimmed(), Path(run) / BUNDLES
    if bdir.is_dir():
        bundles = _bundles(bdir)
        for b in bundles[: max(0, len(bundles) - keep_bundles)]:
            _remove(b, out, out.bundles)
    return out
