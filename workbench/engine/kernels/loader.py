"""The one loader: each native extension found (or built) in its cache entry once per process,
refused when it was compiled for CPU features this one lacks.

`Kernel.get()` is on hot paths (rms_norm every layer): after the first call it is one dict
lookup, no lock, no file read. The first call decides, in this order:

1. the extension's switch (PAGEDKV_ATTENTION=torch, PAGEDKV_LINEAR=torch, PAGEDKV_POOL=python,
   read through engine/env.py): off for the whole process, the Python / torch path. The
   EngineConfig field of the same name turns the path off for one engine only (the build may
   still be loaded for others). Then the machine: sources written for x86 (intrinsics, x86-only
   flags) are refused on aarch64 or any other machine (PAGEDKV_MACHINE fakes one), and
   PAGEDKV_CPU_FEATURES=none refuses every extension (a CPU that runs no compiled code of ours);
2. the cache entry of these sources, compiler, torch and Python (cache.py); its manifest lists
   the CPU features the build was compiled for. One this CPU lacks: REFUSED, with a warning
   naming the features and the entry, and the Python / torch path runs. We do not rebuild over
   it: the entry is another host's (a shared or copied cache) and would be pulled from under it;
   giving each host its own PAGEDKV_EXTENSIONS_DIR, or deleting the entry, builds for this CPU;
3. no compiler: an entry of the same sources built by another compiler (a baked cache), if its
   features fit this CPU;
4. otherwise build (first use on a machine; `make` does it during setup) and import;
5. the module's trial (trials.py): run once on a tiny input against a reference; a wrong result
   or an error refuses it like a missing feature, with the reason, and the fallback runs.
Kernel.trial() gives the verdict in trials.py's terms, so engine.kernels and `kvwb doctor` list a
refused module beside the other refused paths.
"""
from __future__ import annotations

import importlib
import logging
import threading
from pathlib import Path

from .. import env
from . import cache, trials
from .build import artefact, build_and_import, import_file
from .cpu import (_read as detected_features, cpu_features, faked_text, listed, machine, missing, no_compiled_code,
                  real_machine, target_features)
from .spec import Spec

log = logging.getLogger("workbench.engine.kernels")


class Refused(RuntimeError):
    """A cached build compiled for CPU features this CPU lacks."""


class Kernel:
    """One extension, loaded at most once per process; None (and why()) where it cannot be."""

    def __init__(self, spec: Spec, fallback: str = "the torch path", trial=None):
        self.spec, self.fallback = spec, fallback
        # trial(module) raises where the module gives a wrong result; "package.module:function" names one
        # beside the reference it compares with (imported when the module is first loaded)
        self.tries = trial
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

    def trial(self) -> trials.Trial:
        """This module's verdict as a trial: confirmed, or refused with why() and the fallback."""
        if self.get() is not None:
            return trials.Trial(self.spec.what, True)
        return trials.Trial(self.spec.what, False, self.why(), self.fallback)

    def _load(self):
        spec = self.spec
        if switched_off(spec):
            return None, f"{spec.switch[0]}={spec.switch[1]}", None
        entry = None
        try:
            mod, entry = load(spec)
            if self.tries is not None:
                got = trials.run(spec.what, self.fallback, lambda: _resolve(self.tries)(mod))
                if not got.ok:
                    raise Refused(f"refused the build {entry}: it {got.why}", entry)
            return mod, None, entry
        except Refused as e:
            why, entry = e.args[0], e.args[1]
        except Exception as e:             # no compiler, no headers, a read-only cache, ...
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("%s unavailable (%s): using %s", spec.what, why, self.fallback)
        return None, why, entry


def _resolve(trial):
    if isinstance(trial, str):
        module, _, name = trial.partition(":")
        return getattr(importlib.import_module(module), name)
    return trial


def switched_off(spec: Spec) -> bool:
    """Whether the extension's switch (PAGEDKV_ATTENTION=torch, ...) keeps the Python / torch path
    in this whole process (asked once per extension: get() remembers the answer)."""
    return bool(spec.switch) and env.value(spec.switch[0]) == spec.switch[1]


def built_for(spec: Spec) -> frozenset[str]:
    """The features a build made here is compiled for: this CPU's real ones under -march=native (not
    a PAGEDKV_CPU_FEATURES override: that fakes the CPU that loads, not what the compiler saw); under
    another -march (PAGEDKV_MARCH), what the compiler says that target has."""
    if spec.for_this_cpu:
        return detected_features()
    if spec.march:
        return target_features(spec.march, tuple(cache.compiler_command(spec.kind)))
    return frozenset()


def check(spec: Spec, entry: Path, manifest: dict, have=None, fields: dict | None = None) -> None:
    """Raise Refused when the entry was compiled for features `have` (this CPU) lacks, or (given
    `fields`) when its manifest is not of these sources, compiler and torch (a renamed copy)."""
    built_on, here = manifest.get("machine", real_machine()), machine()
    if built_on != here:
        raise Refused(f"refused the cached build {entry}: it was compiled for {built_on}, and this machine is "
                      f"{here}; the Python / torch path runs instead", entry)
    wrong = [k for k in fields or {} if manifest.get(k) != fields[k]]
    if wrong:
        raise Refused(f"refused the cached build {entry}: its manifest's {', '.join(wrong)} are not this build's "
                      f"(a copy under another entry's name?); the Python / torch path runs instead. Delete that "
                      f"directory to build it again", entry)
    lack = missing(manifest.get("cpu_features", ()), cpu_features() if have is None else have)
    if lack:
        raise Refused(f"refused the cached build {entry}: it was compiled for {listed(lack)}, which this CPU "
                      f"lacks (loading it would crash with SIGILL); the Python / torch path runs instead. Delete "
                      f"that directory, or give this host its own PAGEDKV_EXTENSIONS_DIR, to build for this CPU",
                      entry)


def refuse_by_machine(spec: Spec) -> None:
    """Raise Refused, before anything is built or read, where this machine (or the faked CPU) cannot
    run the extension at all."""
    here = machine()
    if spec.machines is not None and here not in spec.machines:
        raise Refused(f"refused: {spec.what} is written for {' / '.join(spec.machines[:2])} (its intrinsics and "
                      f"compiler flags), and this machine is {here}; the Python / torch path runs instead", None)
    if no_compiled_code():
        raise Refused(f"refused: PAGEDKV_CPU_FEATURES={faked_text()!r} fakes a CPU that runs no compiled code of "
                      f"ours; the Python / torch path runs instead", None)


def load(spec: Spec):
    """(module, entry) for spec, building it where needed; raises Refused or the build's error."""
    refuse_by_machine(spec)
    spec = spec.targeting(env.value("PAGEDKV_MARCH"))
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
