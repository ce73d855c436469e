"""The page pool's per-page loops: Python here, compiled (csrc/pool_ops.c) when a C compiler is at hand.

A simulated replay of a production trace hands out, registers and frees millions of pages:
these loops were half of its time. Each is a plain function over the PagePool's own
arrays, lists and dict (the pool keeps one representation, which probes and views read:
per-page integers in array.array('q') / ('b'), per-page objects in lists), written here in
Python, the reference, and in C with the same arguments and results:

    take(nxt, prv, is_free, page_hash, page_tokens, page_index, page_parent, generation, ref, cached, ids, head, n)
        -> (pages, generations, evicted, head)    n pages off the free queue's head (ids[p]: page p's int)
    release(ref, nxt, prv, is_free, page_hash, pages, head, tail)
        -> (released, still, cached, head, tail, error)   one reference dropped per page
    register_chain(cached, page_hash, page_tokens, page_index, page_parent, pages, chain, index, parent)
        -> (entered, indices)                     consecutive pages entered in the prefix cache
    walk(memo, n, cached, page_tokens) -> (pages, hashes)   the longest cached prefix
    hash_chain(root, parent, blocks) -> [(hash, block), ...]  each hash((previous or root, block))
    count_free(is_free, pages) -> int             how many of pages are on the free queue

The C source is compiled once per machine with the interpreter's own compiler settings (~1 s)
into $PAGEDKV_EXTENSIONS_DIR or ~/.cache/pagedkv-workbench/pool_ops, rebuilt when it changes.
No compiler, or PAGEDKV_POOL=python: the Python functions run, same results, slower.
tests/test_page_pool.py runs the pool on both.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

log = logging.getLogger(__name__)

NIL = -1
SOURCE = Path(__file__).with_name("csrc") / "pool_ops.c"


# ---- the reference: Python ------------------------------------------------------------------
def take(nxt, prv, is_free, page_hash, tokens, index, parent, gen, ref, cached, ids, head, n):
    # ids[p] is page p's int object: the pool's lists then share one object per page id
    # instead of a new int per hand-out (millions in a replay)
    pages, gens, evicted = [], [], []
    p = head
    for _ in range(n):
        if p == NIL:
            raise RuntimeError(f"pool_ops: the free queue ends after {len(pages)} of {n} pages")
        q = nxt[p]
        nxt[p] = prv[p] = NIL
        is_free[p] = False
        if page_hash[p] is not None:
            evicted.append(p)
        gen[p] += 1
        ref[p] = 1
        pages.append(ids[p])
        gens.append(gen[p])
        p = q
    if p != NIL:
        prv[p] = NIL
    for e in evicted:                          # a cached page handed out loses its hash
        h = page_hash[e]
        if cached.get(h) == e:
            del cached[h]
        page_hash[e] = tokens[e] = parent[e] = None
        index[e] = NIL
    return pages, gens, evicted, p


def release(ref, nxt, prv, is_free, page_hash, pages, head, tail):
    released, still, cached, error = [], [], [], None
    try:
        for p in pages:
            r = ref[p]
            if r <= 0:
                raise RuntimeError(f"page {p} freed with refcount {r}")
            ref[p] = r - 1
            if r == 1:                         # onto the free queue's tail
                prv[p], nxt[p] = tail, NIL
                if tail == NIL:
                    head = p
                else:
                    nxt[tail] = p
                tail = p
                is_free[p] = True
                if page_hash[p] is not None:
                    cached.append(p)
                released.append(p)
            else:
                still.append(p)
    except Exception as e:                     # raised by the caller once its counters are kept
        error = e
    return released, still, cached, head, tail, error


def register_chain(cached, page_hash, tokens, page_index, page_parent, pages, chain, index, parent):
    entered, indices = [], []
    for p, (h, key) in zip(pages, chain):
        if page_hash[p] is None and h not in cached:
            cached[h] = p
            page_hash[p] = h
            tokens[p] = key
            page_index[p] = index
            page_parent[p] = parent
            entered.append(p)
            indices.append(index)
        parent = h
        index += 1
    return entered, indices


def walk(memo, n, cached, tokens):
    pages, hashes = [], []
    for h, key in memo[:n]:
        p = cached.get(h)
        if p is None or tokens[p] != key:
            break
        pages.append(p)
        hashes.append(h)
    return pages, hashes


def count_free(is_free, pages):
    return sum(map(is_free.__getitem__, pages))


def hash_chain(root, parent, blocks):
    out = []
    h = root if parent is None else parent
    for block in blocks:
        h = hash((h, block))
        out.append((h, block))
    return out


PYTHON = SimpleNamespace(name="python", take=take, release=release, register_chain=register_chain, walk=walk,
                         hash_chain=hash_chain, count_free=count_free)


# ---- the compiled twin --------------------------------------------------------------------
def build_dir() -> Path:
    env = os.environ.get("PAGEDKV_EXTENSIONS_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return (Path(env) if env else Path(xdg) / "pagedkv-workbench") / "pool_ops"


def _build(source: Path = SOURCE, name: str = "pagedkv_pool_ops") -> Path:
    src = source.read_bytes()
    tag = hashlib.sha256(src + sys.version.encode() + str(sysconfig.get_config_var("EXT_SUFFIX")).encode())
    out_dir = build_dir()
    so = out_dir / f"{name}-{tag.hexdigest()[:16]}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if so.exists():
        return so
    out_dir.mkdir(parents=True, exist_ok=True)
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        cmd = cc + ["-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(source), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:1])} failed: {(done.stderr or done.stdout).strip()[-400:]}")
        os.replace(tmp, so)                   # atomic: a concurrent build (advisor workers) reads a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return so


def load_extension(source: Path, name: str):
    """Compile (once per machine and source) and import the C module `name` from `source`."""
    so = _build(source, name)
    loader = importlib.machinery.ExtensionFileLoader(name, str(so))
    spec = importlib.util.spec_from_file_location(name, str(so), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _load():
    mod = load_extension(SOURCE, "pagedkv_pool_ops")
    return SimpleNamespace(name="compiled", take=mod.take, release=mod.release, register_chain=mod.register_chain,
                           walk=mod.walk, hash_chain=mod.hash_chain, count_free=mod.count_free)


class CompiledOnce:
    """A C twin of some Python loops (python: their namespace), built and loaded on first use by
    make(); None, with the reason, where it cannot be (no compiler, no headers, a read-only
    cache, PAGEDKV_POOL=python)."""

    def __init__(self, make, what: str, python):
        self._make, self._what, self.python = make, what, python
        self._lock = threading.Lock()
        self.state: dict = {}                  # "ops" (None when unavailable) and "why", once tried

    def get(self):
        """The compiled loops, or None (why: why())."""
        if "ops" not in self.state:
            with self._lock:
                if "ops" not in self.state:
                    ops, why = None, None
                    if os.environ.get("PAGEDKV_POOL", "auto") == "python":
                        why = "PAGEDKV_POOL=python"
                    else:
                        try:
                            ops = self._make()
                        except Exception as e:
                            why = f"{type(e).__name__}: {e}"
                            log.warning("compiled %s unavailable (%s): using the Python ones", self._what, why)
                    self.state["ops"], self.state["why"] = ops, why
        return self.state["ops"]

    def why(self) -> str | None:
        self.get()
        return self.state.get("why")

    def active(self):
        """What a new user runs: the compiled loops when they load, else the Python ones."""
        return self.get() or self.python


_compiled = CompiledOnce(_load, "page-pool loops", PYTHON)
compiled, active, unavailable_reason = _compiled.get, _compiled.active, _compiled.why
