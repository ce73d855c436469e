"""The decoded-model cache: a GGUF's decoded weights (weights.py) and its rebuilt tokenizer
(tokenizer.py), kept so that a new process reads them back instead of decoding again.

One entry (a directory) per file and per what produced it: the file's path, size and mtime and
the producer's own version (the loader's format, a library's version), hashed into the name, so
a changed file or library never reads a stale entry. Entries live under PAGEDKV_MODEL_CACHE
(default ~/.cache/pagedkv-workbench/models), shared by every peaks cache_dir(); 0 switches the
cache off. An entry is written aside and renamed (a reader never sees half of one), and one that
fails to read is removed and produced again. No pickle: safetensors and JSON only.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from . import env


def root() -> Path | None:
    """The cache's directory; None with PAGEDKV_MODEL_CACHE=0."""
    moved = env.value("PAGEDKV_MODEL_CACHE")
    if moved == "0":
        return None
    if moved and moved != "1":
        return Path(moved).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedkv-workbench" / "models"


def entry(path: Path, kind: str, produced_by: str) -> Path | None:
    """The entry of `kind` for the file at path, produced by `produced_by`; None when the cache is off."""
    base = root()
    if base is None:
        return None
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{produced_by}".encode()).hexdigest()
    return base / f"{path.stem}-{kind}-{key[:16]}"


def read(at: Path, marker: str, reader: Callable[[Path], Any]) -> Any | None:
    """reader(at) if the entry is complete (its marker file is there); None if absent or damaged
    (then removed, for the caller to produce it again)."""
    if not (at / marker).is_file():
        return None
    try:
        return reader(at)
    except Exception:          # noqa: BLE001 - a cut-off or foreign entry: produced again
        shutil.rmtree(at, ignore_errors=True)
        return None


def write(at: Path, writer: Callable[[Path], None]) -> None:
    """writer(a fresh directory), then renamed to `at`. A full or read-only cache, a value JSON
    cannot hold, or another process that was first: nothing kept, the caller's value still serves."""
    tmp = at.with_name(f"{at.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        writer(tmp)
        os.rename(tmp, at)
    except (OSError, TypeError, ValueError):
        shutil.rmtree(tmp, ignore_errors=True)
