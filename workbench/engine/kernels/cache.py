"""Where builds live and what keys them: one directory per build, a manifest beside it.

    <build_dir()>/<name>-<build id>/        build id: sources + headers, compiler, torch, Python, flags
        manifest.json                       those, plus the CPU features it was compiled for
        <name>.so (torch) / <name><EXT_SUFFIX> (c)

The directory is found by what is built (so a cache copied between hosts, or shared by them, is
found); the manifest says for which CPU. The full key (`cache_key`) is the build id plus those
features: the loader refuses an entry whose features this CPU lacks instead of letting it SIGILL.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from .. import env as env_vars
from .cpu import real_machine
from .spec import Spec

MANIFEST = "manifest.json"


def build_dir() -> Path:
    """$PAGEDKV_EXTENSIONS_DIR, else ~/.cache/pagedkv-workbench/torch_extensions (XDG_CACHE_HOME honoured)."""
    env = env_vars.value("PAGEDKV_EXTENSIONS_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    d = Path(env) if env else Path(xdg) / "pagedkv-workbench" / "torch_extensions"
    d.mkdir(parents=True, exist_ok=True)
    return d


def compiler_command(kind: str) -> list[str]:
    """The compiler a build of `kind` runs: torch's (CXX or c++), or the interpreter's C compiler (CC)."""
    if kind == "torch":
        return shlex.split(os.environ.get("CXX") or "c++")
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


@functools.lru_cache(maxsize=None)
def _version_line(cmd: tuple[str, ...]) -> str | None:
    try:
        out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    first = (out.stdout or "").strip().splitlines()
    return first[0].strip() if out.returncode == 0 and first else None


def compiler_identity(kind: str) -> str | None:
    """The compiler's `--version` first line ("c++ (Debian 12.2.0-14) 12.2.0"), None when it does not run."""
    return _version_line(tuple(compiler_command(kind)))


def torch_version() -> str:
    import torch
    return torch.__version__


def key_fields(spec: Spec, compiler: str | None, torch: str | None = None) -> dict:
    """Everything the build depends on except the CPU's features: what names its directory. The
    machine is the compiler's target (an x86_64 build is never an aarch64 host's entry)."""
    return {"name": spec.name, "kind": spec.kind, "machine": real_machine(), "source_sha256": spec.source_hash(),
            "compiler": compiler, "torch": torch_version() if torch is None else torch,
            "python": f"{sys.implementation.cache_tag}{sysconfig.get_config_var('EXT_SUFFIX') or ''}",
            "flags": list(spec.flags) + list(spec.ldflags)}


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def cache_key(fields: dict, features) -> str:
    """The full key of a build: key_fields plus the CPU features it was compiled for."""
    return _digest({**fields, "cpu_features": sorted(features)})


def entry_dir(spec: Spec, fields: dict) -> Path:
    return build_dir() / f"{spec.name}-{_digest(fields)[:16]}"


def siblings(spec: Spec, fields: dict) -> list[Path]:
    """Entries of the same sources, torch and Python built by any compiler: what a host without
    one (a container with a baked cache) may still load."""
    want = {k: v for k, v in fields.items() if k != "compiler"}
    out = []
    for d in sorted(build_dir().glob(f"{spec.name}-*")):
        m = read_manifest(d)
        if m and {k: m.get(k) for k in want} == want:
            out.append(d)
    return out


def read_manifest(entry: Path) -> dict | None:
    try:
        return json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def write_manifest(entry: Path, fields: dict, features) -> dict:
    m = {**fields, "cpu_features": sorted(features), "key": cache_key(fields, features)}
    entry.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=entry, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(m, f, indent=1, sort_keys=True)
    os.replace(tmp, entry / MANIFEST)          # atomic: a concurrent reader sees the old one or this one
    return m
