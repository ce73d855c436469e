"""Compile one extension into its cache entry and import it; the two ways the engine's are built.

torch kind: torch.utils.cpp_extension.load (ninja; it rebuilds when a source or a flag changes and
holds a lock file in the entry while it builds). c kind: the interpreter's C compiler, one command,
the .so moved into place atomically (advisor workers may build the same entry at once).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from .cache import compiler_command
from .spec import Spec


def artefact(spec: Spec, entry: Path) -> Path:
    """The shared object a build leaves in its entry."""
    if spec.kind == "torch":
        return entry / f"{spec.name}.so"
    return entry / f"{spec.name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def build_and_import(spec: Spec, entry: Path):
    """Build (where the entry is missing or stale) and import the module."""
    entry.mkdir(parents=True, exist_ok=True)
    if spec.kind == "torch":
        from torch.utils.cpp_extension import load   # torch (and its libgomp) already loaded
        return load(name=spec.name, sources=[str(x) for x in spec.sources], extra_cflags=list(spec.flags),
                    extra_ldflags=list(spec.ldflags), build_directory=str(entry), verbose=False)
    so = artefact(spec, entry)
    if not so.exists():
        _compile_c(spec, so)
    return import_file(spec.name, so)


def import_file(name: str, so: Path):
    loader = importlib.machinery.ExtensionFileLoader(name, str(so))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, str(so), loader=loader))
    loader.exec_module(mod)
    return mod


def _compile_c(spec: Spec, so: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
    os.close(fd)
    try:
        cmd = (compiler_command("c") + list(spec.flags) + ["-shared", "-fPIC",
               f"-I{sysconfig.get_paths()['include']}", *map(str, spec.sources), "-o", tmp] + list(spec.ldflags))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed: {(done.stderr or done.stdout).strip()[-400:]}")
        os.replace(tmp, so)                   # atomic: a concurrent build reads a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
