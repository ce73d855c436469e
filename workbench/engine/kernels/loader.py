"""The one loader: each native extension found (or built) in its cache entry once per process,
refused when it was compiled for CPU features this one lacks.

`Kernel.get()` is on hot paths (rms_norm every layer): after the first call it is one dict
lookup, no lock, no file read. The first call decides, in this order:

1. the extension's switch (PAGEDKV_ATTENTION=torch, PAGEDKV_LINEAR=torch, PAGEDKV_POOL=python,
   read through engine/env.py): off for the whole process, the Python / torch path. The
   EngineConfig field of the same name turns the path off for one engine only (the build may
   still be loaded for others);
2. the cache entry of these sources, compiler, torch and Python (cache.py); its manifest lists
   the CPU features the build was compiled for. One this CPU lacks: REFUSED, with a warning
   naming the features and the entry, and the Python / torch path runs. We do not rebuild over
   it: the entry is another host's (a shared or copied cache) and would be pulled from under it;
   giving each host its own PAGEDKV_EXTENSIONS_DIR, or deleting the entry, builds for this CPU;
3. no compiler: an entry of the same sources built by another compiler (a baked cache), if its
   features fit this CPU;
4. otherwise build (first use on a machine; `make` does it during setup) and import.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from .. import env
from . import cache
from .build import artefact, build_and_import, import_file
from .cpu import _read as detected_features, cpu_features, missing
from .spec import Spec

log = logging.getLogger("workbench.engine.kernels")


class Refused(RuntimeError):
    """A cached build compiled for CPU features this CPU lacks."""


class Kernel:
    """One extension, loaded at most once per process; None (and why()) where it cannot be."""

    def __init__(self, spec: Spec, fallback: str = "the torch path"):
        self.spec, self.fallback = spec, fallback
        self._lock = threading.Lock()
        self.state: dict = {}          # "module" (set last: get() reads it without the lock), "why", "entry"

    def get(self):
        st = self.state
        if "module" in st:
            return st["module"]
        with self._lock:
            if "module" not in st:
                mod, why, entry = self._load()
                st["why"], st["entry"] = why, entry
                st["module"] = mod
        return st["module"]

    def why(self) -> str | None:
        """Why get() is None (a switch, a refusal, a failed build); None when it loaded."""
        self.get()
        return self.state.get("why")

    def entry(self) -> Path | None:
        """The cache entry the module came from (or was refused from)."""
        self.get()
        return self.state.get("entry")

    def require(self):
        """The module, or an exception carrying why()."""
        mod = self.get()
        if mod is None:
            raise RuntimeError(self.why())
        return mod

    def _load(self):
        spec = self.spec
        if switched_off(spec):
            return None, f"{spec.switch[0]}={spec.switch[1]}", None
        entry = None
        try:
            mod, entry = load(spec)
            return mod, None, entry
        except Refused as e:
            why, entry = e.args[0], e.args[1]
        except Exception as e:             # no compiler, no headers, a read-only cache, ...
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("%s unavailable (%s): using %s", spec.what, why, self.fallback)
        return None, why, entry


def switched_off(spec: Spec) -> bool:
    """Whether the extension's switch (PAGEDKV_ATTENTION=torch, ...) keeps the Python / torch path
    in this whole process (asked once per extension: get() remembers the answer)."""
    return bool(spec.switch) and env.value(spec.switch[0]) == spec.switch[1]


def built_for(spec: Spec) -> frozenset[str]:
    """The features a build made here is compiled for: this CPU's real ones under -march=native (not
    a PAGEDKV_CPU_FEATURES override: that fakes the CPU that loads, not what the compiler saw)."""
    return detected_features() if spec.for_this_cpu else frozenset()


def check(spec: Spec, entry: Path, manifest: dict, have=None, fields: dict | None = None) -> None:
    """Raise Refused when the entry was compiled for features `have` (this CPU) lacks, or (given
    `fields`) when its manifest is not of these sources, compiler and torch (a renamed copy)."""
    wrong = [k for k in fields or {} if manifest.get(k) != fields[k]]
    if wrong:
        raise Refused(f"refused the cached build {entry}: its manifest's {', '.join(wrong)} are not this build's "
                      f"(a copy under another entry's name?); the Python / torch path runs instead. Delete that "
                      f"directory to build it again", entry)
    lack = missing(manifest.get("cpu_features", ()), cpu_features() if have is None else have)
    if lack:
        raise Refused(f"refused the cached build {entry}: it was compiled for {', '.join(lack)}, which this CPU "
                      f"lacks (loading it would crash with SIGILL); the Python / torch path runs instead. Delete "
                      f"that directory, or give this host its own PAGEDKV_EXTENSIONS_DIR, to build for this CPU",
                      entry)


def load(spec: Spec):
    """(module, entry) for spec, building it where needed; raises Refused or the build's error."""
    compiler = cache.compiler_identity(spec.kind)
    fields = cache.key_fields(spec, compiler)
    if compiler is None:                           # 3: no compiler, only what is already built
        return _load_prebuilt(spec, fields)
    entry = cache.entry_dir(spec, fields)
    manifest = cache.read_manifest(entry) or cache.write_manifest(entry, fields, built_for(spec))
    check(spec, entry, manifest, fields=fields)    # 2: before anything is mapped into this process
    so = artefact(spec, entry)
    before = so.stat().st_mtime_ns if so.exists() else None
    mod = build_and_import(spec, entry)            # 4: a no-op build where the entry is current
    if so.exists() and so.stat().st_mtime_ns != before and manifest["cpu_features"] != sorted(built_for(spec)):
        cache.write_manifest(entry, fields, built_for(spec))   # rebuilt here: for this CPU now
    return mod, entry


def _load_prebuilt(spec: Spec, fields: dict):
    found = [d for d in cache.siblings(spec, fields) if artefact(spec, d).exists()]
    refusals = []
    for entry in found:
        try:
            check(spec, entry, cache.read_manifest(entry) or {})
        except Refused as e:
            refusals.append(e)
            continue
        return import_file(spec.name, artefact(spec, entry)), entry
    if refusals:
        raise refusals[0]
    cmd = " ".join(cache.compiler_command(spec.kind))
    raise RuntimeError(f"no working compiler ({cmd}) and no build of these sources in {cache.build_dir()}")
